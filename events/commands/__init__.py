"""The command path: a person or a part of the system asks, a service decides, one outcome is written.

``command`` (the envelope) → ``signing`` (Ed25519 over its bytes) → ``client`` (send, await the
outcome) → ``processor`` (decode strictly, verify, authorize, one outcome per command) →
``shell`` (catch up, already applied?, decide, append, retry). ``auth`` checks who signed,
``roles`` is the pure rule of who may do what where, ``audit`` checks every signature again later.
"""
