"""The wire protocol: framing, messages and argument checks, sans I/O.

Layering rules (tests/test_layering.py imports each module alone and checks them):

  Rule 1: nothing here touches a socket, a file or the core. The daemon and the client read bytes
          however they like and `feed` them to a FrameDecoder, which returns complete frames;
          everything else is a pure function from bytes or objects to objects or bytes, so partial
          reads, coalesced frames and hostile input are plain unit tests (the h11 shape).
  Rule 2: the protocol imports nothing of kvd.core, kvd.server, kvd.client or kvd.segment, and
          not numpy: a client loads it without the pool.
  Rule 3: each concern is one file, testable on bytes alone, each importing only those above it:
          framing.py   a byte stream <-> frame bodies: the length prefix and its cap
          messages.py  frame bodies <-> requests and replies: the limits inside a body, the
                       message shapes, the errors they carry; msgspec as the fast path
          checks.py    a request's args -> checked values: the validators and the hot ops'
                       schemas; kvd/protocol/_checks.c as the fast path
  Rule 4: every fast path is optional and one-sided: it answers only what its Python
          specification answers the same, and leaves everything else to it; the compiled
          modules come through kvd/native.py, and `use_c` switches them in one process.

This package re-exports the names the rest of kvd uses.
"""

from __future__ import annotations

from typing import Any

from kvd.protocol import checks, messages
from kvd.protocol.checks import (
    ARG_BYTES_LIST, ARG_INT, ARG_INT_LIST, ArgField, arg_bool, arg_bytes, arg_bytes_list,
    arg_int, arg_int_list, arg_str, args_of, bytes_list_field, check_no_extra, int_field,
    int_list_field,
)
from kvd.protocol.framing import MAX_FRAME_NBYTES, check_frame_length
from kvd.protocol.messages import (
    MAX_ARRAY_LEN, MAX_MAP_LEN, MAX_OP_NBYTES, MAX_REQUEST_ID, MAX_STR_NBYTES, MAX_UINT64,
    PROTOCOL_VERSION, FrameDecoder, FrameEncoder, codec, decode_reply, decode_request,
    encode_error, encode_frame, encode_request, encode_result, parse_reply, parse_request,
    unpack_body,
)

call_hot: Any = checks.call_hot  # (use_c rebinds it: the Service looks it up per request)


def use_c(enabled: bool) -> bool:
    """Turn the protocol's compiled fast paths -- msgspec's codec and kvd/protocol/_checks.c --
    on or off in this process, for benches and twin tests that compare them with the Python in
    one run; returns whether any is on (neither is where they are missing, or with
    KVD_PURE_PYTHON=1)."""
    global call_hot
    is_codec_on = messages.use_msgspec(enabled)
    is_checks_on = checks.use_c(enabled)
    call_hot = checks.call_hot
    return is_codec_on or is_checks_on


__all__ = [
    "ARG_BYTES_LIST", "ARG_INT", "ARG_INT_LIST", "MAX_ARRAY_LEN", "MAX_FRAME_NBYTES",
    "MAX_MAP_LEN", "MAX_OP_NBYTES", "MAX_REQUEST_ID", "MAX_STR_NBYTES", "MAX_UINT64",
    "PROTOCOL_VERSION", "ArgField", "FrameDecoder", "FrameEncoder", "arg_bool", "arg_bytes",
    "arg_bytes_list", "arg_int", "arg_int_list", "arg_str", "args_of", "bytes_list_field",
    "call_hot", "check_frame_length", "check_no_extra", "codec", "decode_reply",
    "decode_request", "encode_error", "encode_frame", "encode_request", "encode_result",
    "int_field", "int_list_field", "parse_reply", "parse_request", "unpack_body", "use_c",
]
