"""What the log runs on: nats-server, its users and permissions, TLS certificates, backups, secret files.

``natsd`` launches a nats-server (for ``llmgw up``, the benchmarks and the tests);
``nats_permissions`` are its users and what each may publish and subscribe to; ``pki`` is the
installation's CA and certificates; ``backup`` copies every stream with the server's own snapshot
API; ``private`` writes a file only its owner may read. Nothing in ``events/`` imports this folder.
"""
