"""JSON-RPC 2.0 framing: parse one incoming message, build result and error bodies; read and written by orjson,
with the standard library for what orjson does not do its way. Sans-IO: no aiohttp, no asyncio."""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.errors import InvalidRequestError, ParseError, RequestId

JSON = dict[str, Any]


@dataclass(frozen=True, slots=True)
class RawJSON:
    """A JSON value kept as the compact text it was stored as: a settled task's result, which can be megabytes.
    `dumps` splices the text into the message as it is, so answering `tasks/get` for a large result costs a copy
    instead of decoding and encoding it again on the event loop. `value()` decodes it for code that looks inside.
    """

    text: str

    def value(self) -> Any:
        return json.loads(self.text)


# What `dumps` writes where a RawJSON goes, then replaces with its text. The random part is never sent, so no
# string a client or an upstream sends can imitate it.
_RAW_MARK: Final = f"\x00raw-json:{secrets.token_hex(16)}:"


@dataclass(frozen=True, slots=True)
class Request:
    id: RequestId
    method: str
    params: JSON | None
    raw: JSON


@dataclass(frozen=True, slots=True)
class Notification:
    method: str
    params: JSON | None
    raw: JSON


@dataclass(frozen=True, slots=True)
class Response:
    """A JSON-RPC response: exactly one of `result` / `error` is set."""

    id: RequestId | None
    result: JSON | None
    error: JSON | None
    raw: JSON


Message = Request | Notification | Response


# Deeper bodies are refused at parse time: every later step (validation, re-encoding, the store) recurses over
# the value, and Python's recursion limit must never be what stops it. serde_json's default limit, too.
MAX_DEPTH: Final = 128

# An escaped UTF-16 surrogate (`\ud800`..`\udfff`): the only way a JSON text in valid UTF-8 can carry one.
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
_LONE_SURROGATE: Final = "Parse error: a string holds a lone UTF-16 surrogate"
_TOO_DEEP: Final = f"Parse error: arrays and objects nested deeper than {MAX_DEPTH} levels"


def _finite(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError("number out of range")
    return number


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Made once: `json.loads` with hooks builds a decoder and its scanner on every call.
_DECODER: Final = json.JSONDecoder(parse_float=_finite, parse_constant=_not_json)

# Nineteen digits in a row: maybe an integer beyond 64 bits, which orjson would read as a float (losing digits).
# Such a text (rare: ids and values that big, or a long digit run in a string) is read by the standard library.
# Found by mapping every digit to "0" and every other byte to " ", then a substring search: about 1 ns a byte,
# where a regular expression such as [0-9]{19} takes ten times that on a text with no digits (a large result).
_DIGITS_AS_ZERO: Final = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
_NINETEEN_DIGITS: Final = b"0" * 19


_NOT_READ: Final = object()


def _fast(raw: bytes) -> Any:
    """What orjson reads from `raw`, or _NOT_READ when the standard library must read it: a long digit run (above),
    or anything orjson refuses (then the standard library says what is wrong, or reads what orjson does not:
    a BOM, NaN, a lone surrogate)."""
    if _NINETEEN_DIGITS in raw.translate(_DIGITS_AS_ZERO):
        return _NOT_READ
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _NOT_READ


def read(data: bytes | str) -> Any:
    """A JSON text as Python values, as `json.loads` reads it (integers of any size, `NaN`, lone surrogates; bytes
    that are not UTF-8 as U+FFFD): for what an upstream sends, relayed as it is. ValueError if it is not JSON."""
    # A lone surrogate passes into the bytes, which are then not UTF-8: orjson refuses them, json.loads reads them.
    value = _fast(data if isinstance(data, bytes) else data.encode("utf-8", errors="surrogatepass"))
    if value is not _NOT_READ:
        return value
    return json.loads(data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data)


def loads(body: bytes) -> Any:
    """Decode a client's body, accepting only what can be relayed as JSON again. A ParseError for:

    - bytes that are not UTF-8 (RFC 8259, section 8.1; a leading BOM is ignored), or not JSON;
    - `NaN`/`Infinity` literals (Python reads them, JSON has none) and numbers beyond a double (`1e999`);
    - a lone surrogate escape such as `"\\ud800"`: grammatical JSON, but no Unicode character, so the string
      cannot be written to UTF-8 again (a pair such as `"\\ud83d\\ude00"` is one character and is fine);
    - nesting deeper than MAX_DEPTH arrays and objects.
    """
    try:
        decoded = _strict(body)
    except (UnicodeDecodeError, ValueError):
        raise ParseError() from None
    except RecursionError:
        raise ParseError(_TOO_DEEP) from None
    surrogates = _SURROGATE_ESCAPE.search(body) is not None
    if surrogates or body.count(b"[") + body.count(b"{") > MAX_DEPTH:  # else neither can be present
        _check_value(decoded, surrogates=surrogates)
    return decoded


def _strict(body: bytes) -> Any:
    """orjson refuses everything `loads` refuses (NaN, infinities, lone surrogates, bad UTF-8) and reads the rest
    as the standard library does, except a leading BOM and integers past 64 bits: those, and whatever orjson
    refuses (so that the error is the same as ever), take the standard library's path."""
    value = _fast(body)
    return _DECODER.decode(body.decode("utf-8-sig")) if value is _NOT_READ else value


def _check_value(value: Any, *, surrogates: bool) -> None:
    """Walk a decoded value level by level (no recursion, C-speed list work): depth, and lone surrogates in keys
    and strings. `json.loads` joins a valid pair into one character, so any surrogate left is a lone one."""
    if surrogates and isinstance(value, str) and _SURROGATE.search(value):
        raise ParseError(_LONE_SURROGATE)
    level: list[Any] = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise ParseError(_TOO_DEEP)
        children: list[Any] = []
        for item in level:
            children.extend(item.values() if type(item) is dict else item)
        if surrogates:
            texts = [key for item in level if type(item) is dict for key in item]
            texts += [child for child in children if type(child) is str]
            if _SURROGATE.search("".join(texts)):
                raise ParseError(_LONE_SURROGATE)
        level = [child for child in children if type(child) is dict or type(child) is list]


def dumps(message: JSON) -> bytes:
    """Compact UTF-8 JSON, with every `RawJSON` in it spliced in as its text. A lone surrogate (only an upstream's
    answer can still hold one) is written as its `\\u` escape, which JSON allows, instead of failing the whole
    message; so is an integer past 64 bits written whole (both by the standard library, which orjson leaves them
    to). A `NaN` an upstream sent is written as `null` (JSON has no NaN)."""
    try:
        return orjson.dumps(message, default=_fragment, option=_PASSTHROUGH)
    except orjson.JSONEncodeError:
        pass
    try:
        return _dumps(message, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return _dumps(message, ensure_ascii=True).encode()


# What orjson would write its own way (a dataclass as an object, a datetime as text) goes to `_fragment` instead:
# a RawJSON is spliced, anything else is not JSON, as for the standard library.
_PASSTHROUGH: Final = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


def _fragment(value: object) -> orjson.Fragment:
    if not isinstance(value, RawJSON):
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
    return orjson.Fragment(value.text)


def _dumps(message: JSON, *, ensure_ascii: bool) -> str:
    raws: list[str] = []

    def mark(value: object) -> str:
        if not isinstance(value, RawJSON):
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        raws.append(value.text)
        return f"{_RAW_MARK}{len(raws) - 1}"

    text = json.dumps(message, separators=(",", ":"), ensure_ascii=ensure_ascii, default=mark)
    for index, raw in enumerate(raws):
        text = text.replace(json.dumps(f"{_RAW_MARK}{index}"), raw, 1)
    return text


def _valid_id(value: Any) -> bool:
    # JSON-RPC allows numbers with fractions; MCP narrows ids to strings and integers (never bool).
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def classify(obj: Any) -> Message:
    """Turn one decoded JSON value into a Request, Notification or Response, or raise InvalidRequestError."""
    if isinstance(obj, list):
        raise InvalidRequestError("Invalid Request: JSON-RPC batches are not supported")
    if not isinstance(obj, dict):
        raise InvalidRequestError("Invalid Request: expected a JSON object")
    raw_id = obj.get("id")
    request_id = raw_id if _valid_id(raw_id) else None
    if obj.get("jsonrpc") != "2.0":
        raise InvalidRequestError('Invalid Request: "jsonrpc" must be "2.0"', request_id=request_id)
    params = obj.get("params")
    if "method" in obj:
        method = obj["method"]
        if not isinstance(method, str) or not method:
            raise InvalidRequestError('Invalid Request: "method" must be a string', request_id=request_id)
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError('Invalid Request: "params" must be an object', request_id=request_id)
        if "id" not in obj:
            return Notification(method, params, obj)
        if request_id is None:
            raise InvalidRequestError('Invalid Request: "id" must be a string or an integer')
        return Request(request_id, method, params, obj)
    if "result" in obj or "error" in obj:
        result, error = obj.get("result"), obj.get("error")
        if ("result" in obj) == ("error" in obj):
            raise InvalidRequestError("Invalid Request: a response has exactly one of result and error")
        if result is not None and not isinstance(result, dict):
            raise InvalidRequestError('Invalid Request: "result" must be an object', request_id=request_id)
        if error is not None and not isinstance(error, dict):
            raise InvalidRequestError('Invalid Request: "error" must be an object', request_id=request_id)
        return Response(request_id, result, error, obj)
    raise InvalidRequestError("Invalid Request: neither a request, a notification nor a response")


def parse(body: bytes) -> Message:
    return classify(loads(body))


def result_message(request_id: RequestId, result: JSON) -> JSON:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def error_message(request_id: RequestId | None, error: JSON) -> JSON:
    """An error response; `id` is left out (not null) when the request id is unknown, as the schema wants."""
    message: JSON = {"jsonrpc": "2.0", "error": error}
    if request_id is not None:
        message["id"] = request_id
    return message


def request_message(request_id: RequestId, method: str, params: JSON | None = None) -> JSON:
    message: JSON = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        message["params"] = params
    return message


def notification_message(method: str, params: JSON | None = None) -> JSON:
    message: JSON = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    return message
