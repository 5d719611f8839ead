"""URLs as they are shown, and a probed file's URL.

A password in a URL (`https://user:pass@gateway/v1`: a fleet behind a proxy's basic auth;
`postgres://u:pass@db/x`) is a secret, and a URL ends up in metadata, logs, errors and
reprs: each of those shows `shown_url`, never the URL itself."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

# A probed file's URL fragment, before its content hash (checked by `clients/media_urls.py`)
HASH_FRAGMENT = "sha256="


def probed_file_url(path: str, sha256: str | None) -> str:
    """`file://` URL of `path`, percent-encoded (`Path.as_uri`), with the probe's content
    hash as its fragment when there is one (`file:///a%23b.png#sha256=<hex>`)."""
    url = Path(path).as_uri()
    return f"{url}#{HASH_FRAGMENT}{sha256}" if sha256 else url


def url_password(value: str) -> str | None:
    """The password in `value`'s userinfo when it is a URL with one; None otherwise."""
    try:
        return urlsplit(value.strip()).password or None
    except ValueError:  # not a URL (a stray '[' reads as a broken IPv6 host)
        return None


def shown_url(url: str) -> str:
    """`url` with its password, if any, as `***`: `https://user:***@host/v1`."""
    if url_password(url) is None:
        return url
    parts = urlsplit(url.strip())
    userinfo, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}").geturl()
