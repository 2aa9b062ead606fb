"""Where the CLI keeps the token it signs in with, and which one it uses.

In order: ``LLMGW_TOKEN``; the token `llmgw login` saved for that admin API (in
``$XDG_CONFIG_HOME/llmgw/credentials.json``, else ``~/.config/llmgw/credentials.json``, mode 0600);
on the machine running `llmgw up`, the first administrator's token in ``DATA_DIR/admin-token``
(0600), so the commands in the README need no login there.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from llmgw.cli.from_services import ADMIN_TOKEN_FILE
from llmgw.infra.private import write_private


def credentials_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw" / "credentials.json"


def _saved() -> dict[str, str]:
    try:
        return msgspec.json.decode(credentials_file().read_bytes(), type=dict[str, str])
    except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return {}


def token_for(api_url: str | None, data_dir: Path | None) -> str | None:
    """The token to send to ``api_url``, or None (the call goes out unauthenticated)."""
    if os.environ.get("LLMGW_TOKEN"):
        return os.environ["LLMGW_TOKEN"].strip()
    if api_url and (saved := _saved().get(api_url.rstrip("/"))):
        return saved
    if data_dir is not None:
        try:
            return (data_dir / ADMIN_TOKEN_FILE).read_text().strip() or None
        except OSError:
            return None
    return None


def save_token(api_url: str, token: str) -> Path:
    """Remember ``token`` for ``api_url`` (0600); returns the file."""
    path = credentials_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    saved = _saved() | {api_url.rstrip("/"): token}
    write_private(path, msgspec.json.encode(saved).decode())
    return path


def forget_token(api_url: str) -> str | None:
    """Forget the token saved for ``api_url``; returns it (None: there was none)."""
    saved = _saved()
    token = saved.pop(api_url.rstrip("/"), None)
    if token is not None:
        write_private(credentials_file(), msgspec.json.encode(saved).decode())
    return token
