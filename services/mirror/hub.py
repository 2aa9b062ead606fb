"""What the mirror asks a Hugging Face–compatible hub, through `huggingface_hub`.

`huggingface_hub` reads the repository (``model_info(files_metadata=True)``: the commit a revision
resolves to, each file's size, its LFS sha256 or git blob id, whether it is gated) and builds
file URLs (``hf_hub_url``). The bytes themselves are fetched by the mirror (:mod:`.download`):
`hf_hub_download` checks sizes only, never sha256, and does not resume what an earlier process
left behind; both are the mirror's work.

Outbound safety (:mod:`llmgw.modelfiles.outbound`): before each metadata call the endpoint's host is
resolved and checked with the same rule the mirror's downloads connect under, so a hub on a
private, loopback or link-local address is refused unless ``allow_private``. ``huggingface_hub``
then resolves and connects on its own: a redirect it follows during that call, or a DNS answer
that changes between the check and its connection, is not seen. The bytes never travel that way:
they are fetched through the mirror's own session, whose resolver checks every connection.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from llmgw.modelfiles.outbound import DestinationRefused, OutboundResolver
from llmgw.services.mirror.rules import HubEntry, HubInfo

DEFAULT_HUB = "https://huggingface.co"


class HubError(Exception):
    """The hub could not answer what was asked; the message says what to check."""

    def __init__(self, message: str, code: str) -> None:
        self.message = message
        self.code = code
        super().__init__(message)


def shown(url: str) -> str:
    """``url`` without the credentials it may carry (``https://user:secret@hub``): what messages and events say."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = parts.hostname or ""
    netloc = f"[{netloc}]" if ":" in netloc else netloc
    netloc += f":{parts.port}" if parts.port is not None else ""
    return parts._replace(netloc=netloc).geturl()


def origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


class HubClient:
    def __init__(
        self,
        endpoint: str = DEFAULT_HUB,
        token: str | None = None,
        timeout_s: float = 20.0,
        *,
        resolver: OutboundResolver | None = None,
    ) -> None:
        """``resolver``: the outbound rule the endpoint is checked with; without one, private addresses are refused."""
        self.endpoint = endpoint.rstrip("/")
        self.shown = shown(self.endpoint)  # the endpoint as messages and events name it
        self.token = token
        self.timeout_s = timeout_s
        self.resolver = resolver if resolver is not None else OutboundResolver(allow_private=False)
        # token=False, not None: without a configured token, never pick up one lying in ~/.cache.
        self._api = HfApi(endpoint=self.endpoint, token=token or False)

    async def info(self, repo: str, revision: str) -> HubInfo:
        """The repository at ``revision``; raises :class:`HubError`."""
        await self.check_endpoint()
        try:
            mi = await asyncio.to_thread(
                self._api.model_info, repo, revision=revision, files_metadata=True, timeout=self.timeout_s
            )
        except GatedRepoError as exc:
            raise HubError(
                f"{repo} is gated on the hub: accept its terms and configure a token (HF_TOKEN), "
                "or choose another repository",
                "gated",
            ) from exc
        except RevisionNotFoundError as exc:
            raise HubError(f"{repo} has no revision {revision!r} on {self.shown}", "no_revision") from exc
        except RepositoryNotFoundError as exc:
            raise HubError(
                f"there is no repository {repo} on {self.shown}, or it is private: check the name, "
                "or configure a token that can read it (HF_TOKEN)",
                "not_found",
            ) from exc
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else "?"
            raise HubError(f"the hub at {self.shown} answered {status} for {repo}: {exc}", "hub") from exc
        except Exception as exc:  # connection refused, DNS, timeouts: whatever the HTTP stack raises
            raise HubError(
                f"the hub at {self.shown} did not answer ({type(exc).__name__}: {exc}): check its address "
                "(HF_ENDPOINT) and the network, then send the fetch again",
                "hub_unreachable",
            ) from exc
        if not mi.sha:
            raise HubError(f"the hub did not say which commit {repo} at {revision!r} is", "hub")
        files = []
        for s in mi.siblings or []:
            lfs = s.lfs
            files.append(
                HubEntry(
                    path=s.rfilename,
                    size=lfs.size if lfs is not None else s.size,
                    sha256=lfs.sha256.lower() if lfs is not None else None,
                    blob_id=s.blob_id,
                )
            )
        gated = mi.gated if isinstance(mi.gated, str) else ("manual" if mi.gated else None)
        return HubInfo(repo=repo, commit=mi.sha, gated=gated, files=files)

    async def check_endpoint(self) -> None:
        """Raises :class:`HubError` (``refused_destination``) when the endpoint resolves where the rule forbids."""
        try:
            await self.resolver.addresses(self.endpoint)
        except DestinationRefused as exc:
            raise HubError(f"the hub at {self.shown} is refused: {exc.reason}", "refused_destination") from exc
        except OSError:
            pass  # an unknown name: the metadata call itself fails and says so (hub_unreachable)

    def file_url(self, repo: str, commit: str, path: str) -> str:
        """The resolve URL of ``path`` at ``commit``: pinned, so a branch that moves mid-fetch changes nothing."""
        return hf_hub_url(repo, path, revision=commit, endpoint=self.endpoint)

    def auth_for(self, url: str) -> dict[str, str]:
        """The token goes to the hub only, never to the CDN it redirects to."""
        if self.token and origin(url) == origin(self.endpoint):
            return {"Authorization": f"Bearer {self.token}"}
        return {}
