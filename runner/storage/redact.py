"""Keep credentials embedded in a URL (`http://user:secret@host`) out of every message."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

# the userinfo part of any scheme://userinfo@host in free text (botocore's own messages
# quote the request URL): everything up to the LAST '@' before the next '/' or line end,
# because a password may itself hold '@', spaces or quotes. Greedy on purpose: redacting
# too much of a line is harmless, showing part of a password is not.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\r\n]*@")


def redact_text(text: str) -> str:
    """text with the userinfo of every URL in it replaced by `***`."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def redact_url(url: str) -> str:
    """url with everything before the last '@' of its host part replaced by `***`; text that
    does not parse as a URL is redacted as free text."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed '[' of an IPv6 host
        return redact_text(url)
    if "@" not in parts.netloc:
        return redact_text(url)  # no userinfo in the host part; the rest may still quote one
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, parts.fragment))


def has_userinfo(url: str) -> bool:
    return "@" in urlsplit(url).netloc


def strip_userinfo(url: str) -> str:
    """url without its `user:password@` (S3 requests are signed with the AWS keys; a
    userinfo part is never used, only echoed)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
