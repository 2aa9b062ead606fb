"""Where the admin API may listen (issue "Trust", item 6): a pure rule, applied before it binds.

The admin API asks every caller for a token (docs/people.md); tokens and passwords must not cross
a network in the clear. So it listens beyond loopback only when it serves TLS (``--tls-cert``);
without TLS it stays on loopback, reached from another machine through an SSH tunnel, unless the
operator says ``--insecure``, which is then logged as a warning at every start, so the choice is
never silent nor forgotten.
A process that runs no ``api`` service serves only ``/healthz`` and ``/metrics`` on its admin port
(read-only, for Prometheus on another machine): that may listen anywhere.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable from this machine only."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another name: it may resolve to anything


def exposure_refusal(host: str, port: int, serves_api: bool, tls: bool = False) -> str | None:
    """Why the admin API may not listen on ``host``:``port`` without ``--insecure``, or None when it may."""
    if not serves_api or is_loopback(host) or tls:
        return None
    return (
        f"the admin API would listen on {host}:{port}, beyond this machine, with no TLS: the passwords and "
        "tokens it is called with would cross the network in the clear. Serve it over TLS (--tls-cert and "
        "--tls-key; `llmgw ctl cert` makes them), or keep it on loopback (--admin-host 127.0.0.1, the default) "
        "and reach it through an SSH tunnel, or pass --insecure to accept the risk (a warning is then logged "
        "at every start)"
    )
