"""Peer network: chunk servers in every holder, their client, a peer-backed store, relay forwarding.

    auth            shared-secret request tokens (HMAC-SHA256, skew window, replay guard)
    wire            the framed-TCP protocol: frame layout, ops, limits
    aio             async frame I/O on raw sockets; cut-through forwarding of a pushed chunk
    server          ChunkServer: serves the versions a holder holds (store objects, dense ranges)
    leases          read leases: a holder's apply waits for dense readers (bounded)
    client          PeerClient: get / get_range / dense_range / push, with timeouts
    peerstore       PeerStore: a Store for receivers that fetches from peers, verified, with failover
    relay           RelayTee: a publisher-side Store that streams chunks to the relay tree's roots
    bench_transport loopback throughput of one stream: aiohttp HTTP vs framed TCP vs the stack

The hub (versions, holders, leases, relay-tree planning) lives in `hub*`, `plan` and `hubclient`.
Submodules are imported explicitly; this package imports nothing on its own.
"""
