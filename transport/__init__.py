"""The wire: every message between Relay's processes and the sockets that carry them.

It owns the message structs (``messages``, one module), the codec (msgpack plus raw
zero-copy tensor frames; never pickle), ZeroMQ request-reply and push-pull sockets with
timeouts and typed errors, endpoints, CURVE security and client roles (which part a peer
plays, bounded by its key). It knows the shapes of the conversation, not what any process
does with a message.
"""
