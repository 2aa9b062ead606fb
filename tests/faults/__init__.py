"""The fault suite: a cluster on loopback under steady load, one fault at a time (`make test-faults`)."""
