"""Engine processes: the protocol side (server, connection) around a runner (fake or model)."""
