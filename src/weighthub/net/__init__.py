"""Transport: chunk servers in every holder and their client, over framed TCP with auth.

    auth     shared-secret request tokens (HMAC-SHA256, skew window, replay guard)
    wire     the framed-TCP protocol: frame layout, ops, limits
    admission  what a connection must do before it holds a serving slot: a whole-request
             deadline, pending caps per source and in total
    aio      async frame I/O on raw sockets; cut-through forwarding of a pushed chunk
    server   ChunkServer: serves the versions a holder holds (store objects, dense ranges)
    client   PeerClient: get / get_range / dense_range / push, with timeouts

Who holds what, the hub, relay plans and the node daemon live in `weighthub.cluster`; this
package imports no model code. Submodules are imported explicitly; it imports nothing on its own.
"""
