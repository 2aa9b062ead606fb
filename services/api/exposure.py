"""Where the admin API may listen (issue "Trust", item 6): a pure rule, applied before it binds.

The admin API changes keys, limits, budgets and the catalog. Until it serves TLS and asks who is
calling, it listens on loopback only: reached from another machine through an SSH tunnel or a proxy
that authenticates. Listening beyond loopback is refused unless the operator says ``--insecure``,
which is then logged as a warning at every start, so the choice is never silent nor forgotten.
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


def exposure_refusal(host: str, port: int, serves_api: bool) -> str | None:
    """Why the admin API may not listen on ``host``:``port`` without ``--insecure``, or None when it may."""
    if not serves_api or is_loopback(host):
        return None
    return (
        f"the admin API would listen on {host}:{port}, beyond this machine, with no TLS and no authentication: "
        "anyone who reaches it could change keys, limits, budgets and the catalog. Keep it on loopback "
        "(--admin-host 127.0.0.1, the default) and reach it through an SSH tunnel or an authenticating proxy, "
        "or pass --insecure to accept the risk (a warning is then logged at every start)"
    )
