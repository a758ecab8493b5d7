#pragma once
/// The framing every KV handshake message shares (internal to transport/ucx): magic and
/// version words, then one Cap'n Proto message of exactly the size its segment table says.
#include <capnp/message.h>
#include <kj/array.h>

#include <cstdint>
#include <vector>

namespace tandem::ucx {

/// Bounds on reading a peer's handshake message (untrusted): a few KiB of names, keys and
/// addresses.
constexpr size_t max_kv_message_bytes = size_t(1) << 16;

/// The header words and the flat message.
std::vector<uint8_t> frame_kv_message(capnp::MessageBuilder& mb);
/// The aligned words of a framed message, after the magic, version and size checks. Throws
/// tandem::error naming the fix.
kj::Array<capnp::word> unframe_kv_message(const uint8_t* data, size_t size);
/// Reader options bounding a peer message of `words` words.
capnp::ReaderOptions kv_reader_options(size_t words);

}  // namespace tandem::ucx
