"""The engine core in processes of its own: the core process's loop around an EngineCore, the
messages between processes, the clients that reach cores (one or data parallel), their launch and
liveness."""
