"""The cluster: who holds which version, who fetches from whom, and the daemons that do it.

    hubcore    Hub: versions, holders with leases, source ranking, relay plans, retention
    hubstate   the hub's durable state (SQLite)
    hub        `weighthub serve hub`: the hub's HTTP API over hubcore
    hubclient  HubClient: a node's or publisher's synchronous client of the hub
    topology   labels (region ⊃ zone ⊃ host) and source ranking
    plan       relay trees for one refit (pure functions)
    leases     read leases: a holder's apply waits for dense readers (bounded)
    peers      HolderSource: ranked holders as a chunk source, benched when they fail
    relayed    relayed manifests the hub vouched for, as a read-only view of the store
    relay      RelayTee: streams a publisher's chunks into the relay tree's roots
    publisher  NetPublisher: a Publisher whose chunks go down the relay tree while it encodes
    join       elastic join: a newcomer copies a whole version from holders
    node       Node: a rollout worker's daemon (follow, sync, relay, serve)
    node_cli   `weighthub serve node`: options, run a Node until a signal

Built on the transport in `net` (framing, auth, chunk server and client). Submodules are imported
explicitly; this package imports nothing on its own.
"""
