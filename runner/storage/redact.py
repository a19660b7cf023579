"""Keep credentials embedded in a URL (`http://user:secret@host`) out of every message."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

# the userinfo part of any scheme://userinfo@host in free text (botocore's own messages
# quote the request URL)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@\"'`<>]*@")


def redact_text(text: str) -> str:
    """text with the userinfo of every URL in it replaced by `***`."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def has_userinfo(url: str) -> bool:
    return "@" in urlsplit(url).netloc


def strip_userinfo(url: str) -> str:
    """url without its `user:password@` (S3 requests are signed with the AWS keys; a
    userinfo part is never used, only echoed)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
