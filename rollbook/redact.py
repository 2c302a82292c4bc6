"""Detectors of sensitive spans in text, and redaction with them (``rollbook export-data``, docs/export.md).

    rules = parse_rules("email,phone,api_key,ip,mypkg.secrets:find_secrets")
    done = redact("write to bob@example.com or +1 650 253 0000", rules)
    done.text      # 'write to [REDACTED:email] or [REDACTED:phone]'
    done.counts    # {'email': 1, 'phone': 1}

A rule is a name and a detector, a function from a text to the ``(start, end)`` character spans it
finds there. The built-in rules (``BUILTIN_RULES``):

- ``email``: ``local@domain.tld``, a regex (a dotted domain whose last label is 2-63 letters).
- ``phone``: Google's libphonenumber (the ``phonenumbers`` package) in its ``VALID`` leniency: a
  number counts only where a country's numbering plan says such a number exists, so ids, dates,
  prices and version strings are left alone. Numbers written with a country code (``+44 ...``) are
  found whatever the region; national ones (``(650) 253-0000``) are read as numbers of
  ``phone_regions`` (default ``US``).
- ``api_key``: the shapes of ``API_KEY_SHAPES``: provider prefixes (``sk-``, ``AKIA``, ``ghp_``,
  ``xoxb-``, ...), JWTs, PEM private keys, and the value after ``key=`` / ``token:`` /
  ``password=`` / ``Bearer``.
- ``ipv4``, ``ipv6``: candidates found by a regex and kept only when ``ipaddress`` parses them, less
  the addresses that name no host (unspecified, loopback, multicast, reserved).

``ip`` stands for ``ipv4,ipv6``, ``all`` for every built-in rule. A user's rule is
``package.module:function``: ``function(text)`` returns an iterable of ``(start, end)`` pairs (a
``re.Match`` counts as its ``.span()``), ``0 <= start <= end <= len(text)``; empty spans are ignored.

Redaction replaces each span with ``[REDACTED:<rule>]``. Spans that overlap (from one rule or
several) are merged into one region, so no character any rule flagged survives; the region is
labelled with the rule of the span that starts first (the longer one when two start together, then
the rule listed first) and counts once, for that rule. The built-in detectors and the redaction are
pure functions: the same text and rules give the same output. With every built-in rule a text of
about 280 characters costs some 30 us on one core (100,000 of them in about 3.5 s; docs/export.md,
"Speed"), most of it in the phone and api_key rules.

Detectors are heuristics: they find the shapes above and miss what does not look like them (a key
without a known prefix or keyword, a phone number of a region not listed, an address spelled out in
words). This is one layer of defense, not a guarantee (docs/export.md, "Limits").
"""

from __future__ import annotations

import difflib
import functools
import importlib
import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollbook.errors import ConfigError

Span = tuple[int, int]
Detector = Callable[[str], Iterable[Any]]

# ---- email -------------------------------------------------------------------------------------

# The local part starts at a boundary (no local-part character before it, so a match never starts
# mid-word), the domain is dot-separated labels ending in a 2-63 letter TLD not followed by more
# label characters: "a@b.com." keeps its full stop, "user@localhost" (no TLD) is not an address, nor
# is an image file named for a pixel density ("icon@2x.png", whose "TLD" is a file extension).
_EMAIL = re.compile(
    r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]+@"
    r"(?!\d+(?:\.\d+)?x\.(?:png|jpe?g|gif|svg|webp|avif)(?![A-Za-z0-9\-]))"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,63}(?![A-Za-z0-9\-])"
)


def find_emails(text: str) -> list[Span]:
    """Email addresses (``user.name+tag@mail.example.co.uk``)."""
    if "@" not in text:
        return []
    return [m.span() for m in _EMAIL.finditer(text)]


# ---- api_key -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyShape:
    """One shape of secret: ``pattern`` finds it; ``group`` is the part redacted (0: the whole match,
    1: the value after a keyword, which stays readable). ``hints``: strings one of which every match
    contains (in the lower-cased text when ``lower``): a text without any skips the regex, which is
    most of the cost on ordinary text (a pattern that starts with a look-behind scans every position)."""

    name: str
    pattern: re.Pattern[str]
    hints: tuple[str, ...]
    group: int = 0
    lower: bool = False
    needs_digit: bool = False  # the value must hold a digit and a letter (random, not a word)


_VALUE = r"[A-Za-z0-9+/=_.~\-]"
API_KEY_SHAPES: tuple[KeyShape, ...] = (
    # OpenAI (sk-..., sk-proj-...), Anthropic (sk-ant-...), and the many services that copied the prefix
    KeyShape("sk- key", re.compile(r"(?<![A-Za-z0-9_\-])sk-[A-Za-z0-9_\-]{20,}"), ("sk-",)),
    # AWS access key ids: a 4-character prefix and 16 upper-case letters or digits
    KeyShape(
        "AWS access key id",
        re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z0-9]{16}(?![A-Za-z0-9])"),
        ("AKIA", "ASIA", "ABIA", "ACCA", "A3T"),
    ),
    # GitHub personal, OAuth, user-to-server, server-to-server and refresh tokens; fine-grained tokens
    KeyShape(
        "GitHub token",
        re.compile(r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})"),
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    ),
    # Slack bot, user, app, refresh and legacy tokens
    KeyShape("Slack token", re.compile(r"(?<![A-Za-z0-9])xox[abeoprs]-[A-Za-z0-9\-]{10,}"), ("xox",)),
    # Google API keys
    KeyShape("Google API key", re.compile(r"(?<![A-Za-z0-9_\-])AIza[0-9A-Za-z_\-]{35}"), ("AIza",)),
    # Stripe secret and restricted keys
    KeyShape("Stripe key", re.compile(r"(?<![A-Za-z0-9])[rs]k_(?:live|test)_[0-9A-Za-z]{16,}"), ("k_live_", "k_test_")),
    # JSON Web Tokens: three base64url parts, the first two JSON objects ("eyJ" = '{"')
    KeyShape("JWT", re.compile(r"(?<![A-Za-z0-9_\-])eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"), ("eyJ",)),
    # PEM private keys, up to their END line, or to the end of a text that was cut short
    KeyShape(
        "PEM private key",
        re.compile(r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY-----(?:.*?-----END[A-Z0-9 ]*PRIVATE KEY-----|.*)", re.DOTALL),
        ("PRIVATE KEY-----",),
    ),
    # the value after a key/token/secret keyword that starts a name or follows a _ . - separator in
    # one (api_key=, X-Api-Key:, GITHUB_TOKEN=, "client_secret": "..."; not monkey=): 16+ characters
    # of hex/base64/url-safe text holding a digit and a letter (so primary_key=user_profile_id is
    # left alone; a digit-free secret is missed)
    KeyShape(
        "key=value",
        re.compile(
            r"(?i)(?<![A-Za-z0-9])(?:api[_\-]?key|key|token|secret|credentials?)"
            rf"[\"']?\s*[:=]\s*[\"']?({_VALUE}{{16,}})"
        ),
        ("key", "token", "secret", "credential"),
        group=1,
        lower=True,
        needs_digit=True,
    ),
    # the value after a password keyword: 6+ characters up to a space, quote, comma or semicolon
    KeyShape(
        "password=value",
        re.compile(r"(?i)(?<![A-Za-z0-9])(?:password|passwd|pwd)[\"']?\s*[:=]\s*[\"']?([^\s\"',;]{6,})"),
        ("password", "passwd", "pwd"),
        group=1,
        lower=True,
    ),
    # HTTP bearer credentials
    KeyShape(
        "Bearer token", re.compile(r"(?i)(?<![A-Za-z0-9])bearer\s+([A-Za-z0-9._~+/\-]{16,}=*)"), ("bearer",), group=1, lower=True
    ),
)
_HAS_DIGIT = re.compile(r"\d")
_HAS_LETTER = re.compile(r"[A-Za-z]")


def find_api_keys(text: str) -> list[Span]:
    """Secrets of the shapes in ``API_KEY_SHAPES``."""
    spans: list[Span] = []
    lowered: str | None = None
    for shape in API_KEY_SHAPES:
        haystack = text
        if shape.lower:
            lowered = haystack = text.lower() if lowered is None else lowered
        if not any(hint in haystack for hint in shape.hints):
            continue
        for m in shape.pattern.finditer(text):
            if shape.needs_digit:
                value = m.group(shape.group)
                if not (_HAS_DIGIT.search(value) and _HAS_LETTER.search(value)):
                    continue
            spans.append(m.span(shape.group))
    return spans


# ---- ipv4, ipv6 --------------------------------------------------------------------------------

# four dot-separated numbers, not part of a longer dotted number or word ("1.2.3.4.5", "v1.2.3.4");
# a full stop after the address is allowed ("... from 10.0.0.7.")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\.?\d)(?!\w)")
# two or more colon-terminated hex groups (empty ones for "::"), then a last group or a dotted IPv4
# tail; not inside a longer word or colon run ("std::map", "12:30:45" parse as no address)
_IPV6 = re.compile(r"(?<![0-9A-Za-z:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{1,4})?(?![0-9A-Za-z:])")
_HEX_DIGIT = re.compile(r"[0-9A-Fa-f]")


def _names_a_host(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """False for addresses that identify no machine: 0.0.0.0 / ::, loopback, multicast, reserved
    (broadcast and netmasks such as 255.255.255.0 are in the reserved range)."""
    return not (address.is_unspecified or address.is_loopback or address.is_multicast or address.is_reserved)


def find_ipv4(text: str) -> list[Span]:
    """IPv4 addresses in dotted-quad form that ``ipaddress`` accepts (no octet above 255, no leading
    zeros) and that name a host."""
    if "." not in text:
        return []
    spans = []
    for m in _IPV4.finditer(text):
        try:
            address = ipaddress.IPv4Address(m.group())
        except ValueError:
            continue
        if _names_a_host(address):
            spans.append(m.span())
    return spans


def find_ipv6(text: str) -> list[Span]:
    """IPv6 addresses (full, ``::``-compressed, IPv4-mapped) that ``ipaddress`` accepts and that name
    a host. Forms with fewer than 4 hex digits in all (``a::b``, ``c::d``) are taken for code, not
    addresses. A zone (``%eth0``) is left in place."""
    if text.count(":") < 2:
        return []
    spans = []
    for m in _IPV6.finditer(text):
        candidate, (start, end) = m.group(), m.span()
        if candidate.endswith(":") and not candidate.endswith("::"):  # "... at fe80::1:" ends a clause
            candidate, end = candidate[:-1], end - 1
        if len(_HEX_DIGIT.findall(candidate)) < 4:
            continue
        try:
            address = ipaddress.IPv6Address(candidate)
        except ValueError:
            continue
        if _names_a_host(address.ipv4_mapped or address):  # ::ffff:a.b.c.d is judged as a.b.c.d
            spans.append((start, end))
    return spans


# ---- phone -------------------------------------------------------------------------------------

# Where a phone number could be: 7 or more digits, each within 3 separator characters of the next.
# libphonenumber's matcher scans every character of the text it gets (about 0.5 ms for 500
# characters), so it only reads these windows, with PHONE_CONTEXT characters on each side: the "+" or
# "(" before the first digit, and what its own checks read before and after a number.
_PHONE_WINDOW = re.compile(r"\d(?:[\s().\-/\u2010-\u2015]{0,3}\d){6,}")
PHONE_CONTEXT = 4
DEFAULT_PHONE_REGIONS = ("US",)


def _phonenumbers() -> Any:
    try:
        import phonenumbers
    except ImportError:
        raise ConfigError(
            "the phone rule needs Google's libphonenumber for Python: pip install phonenumberslite "
            "(or phonenumbers); or leave phone out of the rules"
        ) from None
    return phonenumbers


def check_phone_regions(regions: Iterable[str]) -> tuple[str, ...]:
    """``regions`` as upper-case ISO 3166 codes libphonenumber knows; an unknown one is a ``ConfigError``."""
    known = _phonenumbers().SUPPORTED_REGIONS
    out = tuple(dict.fromkeys(r.strip().upper() for r in regions if r.strip()))
    if not out:
        raise ConfigError("phone regions: give at least one region code, e.g. US or US,GB,DE")
    for region in out:
        if region not in known:
            raise ConfigError(f"phone region {region!r} is not a region libphonenumber knows (ISO 3166 codes such as US, GB, DE)")
    return out


def find_phones(text: str, regions: Sequence[str] = DEFAULT_PHONE_REGIONS) -> list[Span]:
    """Phone numbers valid in their country's numbering plan: with a country code in any region,
    without one as a number of one of ``regions``."""
    phonenumbers = _phonenumbers()
    spans = []
    for window in _PHONE_WINDOW.finditer(text):
        lo = max(0, window.start() - PHONE_CONTEXT)
        piece = text[lo : window.end() + PHONE_CONTEXT]
        for region in regions:
            for found in phonenumbers.PhoneNumberMatcher(piece, region, leniency=phonenumbers.Leniency.VALID):
                spans.append((lo + found.start, lo + found.end))
    return spans


# ---- rules -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A name (the label in ``[REDACTED:<name>]`` and the key of the counts) and its detector."""

    name: str
    find: Detector = field(compare=False)
    user: bool = False  # a user's module:function: its answers are checked


BUILTIN_RULES: dict[str, Detector] = {
    "email": find_emails,
    "phone": find_phones,
    "api_key": find_api_keys,
    "ipv4": find_ipv4,
    "ipv6": find_ipv6,
}
ALIASES: dict[str, tuple[str, ...]] = {"ip": ("ipv4", "ipv6"), "all": tuple(BUILTIN_RULES)}


def parse_rules(spec: str | Sequence[str], *, phone_regions: Sequence[str] = DEFAULT_PHONE_REGIONS) -> tuple[Rule, ...]:
    """The rules of a comma list (``"email,phone,api_key,ip,mypkg.mod:find_secrets"``; ``all`` for
    every built-in one), in the order given, each once. Anything that cannot be used is a
    ``ConfigError`` naming it: an unknown name (with the closest built-in one), a module that does
    not import, a missing or uncallable function, an unknown phone region."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec)]
    if not any(names):
        raise ConfigError("no redaction rules: give a comma list such as email,phone,api_key,ip (or all)")
    if not all(names):
        raise ConfigError(f"redaction rules {','.join(names)!r}: an empty name between commas")
    rules: dict[str, Rule] = {}
    for name in names:
        for one in ALIASES.get(name, (name,)):
            if one in rules:
                continue
            if one == "phone":
                regions = check_phone_regions(phone_regions)
                rules[one] = Rule(one, functools.partial(find_phones, regions=regions))
            elif one in BUILTIN_RULES:
                rules[one] = Rule(one, BUILTIN_RULES[one])
            elif ":" in one:
                rules[one] = Rule(one, load_user_rule(one), user=True)
            else:
                raise ConfigError(_unknown(one))
    return tuple(rules.values())


def _unknown(name: str) -> str:
    choices = [*BUILTIN_RULES, *ALIASES]
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"unknown redaction rule {name!r}{hint}: the built-in rules are {', '.join(BUILTIN_RULES)} "
        "(ip: ipv4 and ipv6; all: every built-in rule), and a rule of your own is package.module:function"
    )


def load_user_rule(spec: str) -> Detector:
    """The function ``package.module:function`` names (``function`` may be dotted: ``Class.method``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"redaction rule {spec!r}: a rule of your own is package.module:function")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the user's to fix, said in one line
        raise ConfigError(f"redaction rule {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"redaction rule {spec!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"redaction rule {spec!r}: {attr!r} in {module_name!r} is not callable")
    return target


def _checked_spans(rule: Rule, text: str) -> Iterable[Span]:
    """A user rule's answers as spans, each checked: a bad one is a ``ValueError`` naming the rule."""
    for item in rule.find(text):
        span = item.span() if isinstance(item, re.Match) else item
        try:
            start, end = span
        except (TypeError, ValueError):
            raise ValueError(
                f"redaction rule {rule.name!r} returned {item!r}: a rule returns (start, end) pairs of character offsets"
            ) from None
        if not (isinstance(start, int) and isinstance(end, int)) or isinstance(start, bool) or isinstance(end, bool):
            raise ValueError(f"redaction rule {rule.name!r} returned {item!r}: start and end must be integers")
        if not 0 <= start <= end <= len(text):
            raise ValueError(
                f"redaction rule {rule.name!r} returned span ({start}, {end}) for a text of {len(text)} characters: "
                "spans need 0 <= start <= end <= len(text)"
            )
        yield start, end


# ---- redaction ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hit:
    """A merged region to replace, and the rule it is labelled with."""

    start: int
    end: int
    rule: str


@dataclass(frozen=True)
class Redaction:
    """The redacted text and how many regions each rule replaced (rules that replaced none are absent)."""

    text: str
    counts: dict[str, int]


def find(text: str, rules: Sequence[Rule]) -> list[Hit]:
    """Every rule's spans in ``text``, merged where they overlap, in text order. Overlapping spans
    become one region labelled with the rule of the span that starts first (the longer one when two
    start together, then the rule listed first); spans that only touch stay two regions."""
    found: list[tuple[int, int, int]] = []  # (start, -length, rule index): the sort order
    for index, rule in enumerate(rules):
        spans = _checked_spans(rule, text) if rule.user else rule.find(text)
        found.extend((start, start - end, index) for start, end in spans if end > start)
    found.sort()
    merged: list[list[int]] = []  # [start, end, rule index]
    for start, negative_length, index in found:
        end = start - negative_length
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, index])
    return [Hit(start, end, rules[index].name) for start, end, index in merged]


def redact(text: str, rules: Sequence[Rule]) -> Redaction:
    """``text`` with every region ``find`` returns replaced by ``[REDACTED:<rule>]``, and the count
    of regions per rule."""
    hits = find(text, rules)
    if not hits:
        return Redaction(text, {})
    pieces, counts, at = [], dict[str, int](), 0
    for hit in hits:
        pieces += [text[at : hit.start], f"[REDACTED:{hit.rule}]"]
        counts[hit.rule] = counts.get(hit.rule, 0) + 1
        at = hit.end
    pieces.append(text[at:])
    return Redaction("".join(pieces), counts)
