// Shared-secret authentication of kvferry's peers (docs/security.md).
//
// Every process of one deployment holds the same secret (KVFERRY_AUTH_TOKEN, or a file named
// by --auth-token-file). The secret itself never crosses the wire; peers prove they hold it:
//
//   - Engine handshakes (TCP) and the NVLink fd socket: challenge and response. Each side
//     sends a fresh random nonce, and each answers with
//       HMAC-SHA256(K, "kvferry-auth-v1" || context || role || client_nonce || server_nonce)
//     where K = HMAC-SHA256(secret, "kvferry handshake key v1"), `context` names the protocol
//     (engine, fd socket) and `role` the side (client 'C', server 'S'), so that a proof
//     reflected back to its sender, or replayed on another connection, does not verify.
//     Without a secret the same exchange runs with the empty secret (which anyone can
//     compute): two peers without a secret still talk, a peer with one refuses a peer
//     without.
//   - HTTP routes (bootstrap and control servers): "Authorization: Bearer <token>" where the
//     token is hex(HMAC-SHA256(secret, "kvferry http bearer v1")): the engine secret cannot be
//     computed from it.
//
// Proofs and tokens are compared in constant time (CRYPTO_memcmp); nonces and generated
// secrets come from OpenSSL's RAND_bytes.
//
// Thread-safety: plain functions.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "kvferry/status.h"

namespace kvferry {

inline constexpr size_t kAuthNonceBytes = 32;
inline constexpr size_t kAuthProofBytes = 32;  // HMAC-SHA256
// Shortest secret accepted: 16 bytes (128 bits of a random token).
inline constexpr size_t kMinAuthSecretBytes = 16;
// Longest secret accepted (a token file is read whole, so bound it).
inline constexpr size_t kMaxAuthSecretBytes = 4096;

using AuthNonce = std::array<uint8_t, kAuthNonceBytes>;
using AuthProof = std::array<uint8_t, kAuthProofBytes>;

// The protocol a proof belongs to.
enum class AuthContext : uint8_t {
  kEngine = 1,    // the TCP handshake of two transfer engines
  kFdSocket = 2,  // the NVLink transport's Unix socket serving cuMem file descriptors
};

// The side of the handshake a proof comes from.
enum class AuthRole : uint8_t {
  kClient = 'C',
  kServer = 'S',
};

// Whether `secret` may serve as one: at least kMinAuthSecretBytes, at most kMaxAuthSecretBytes.
// `source` names where it came from in the error (e.g. "KVFERRY_AUTH_TOKEN"); the secret itself
// is never part of a message. Errors: kInvalidArgument.
Status CheckAuthSecret(const std::string& secret, const std::string& source);

// Reads a secret from the file at `path`: its contents without trailing whitespace (a final
// newline). Errors: kNotFound (cannot be opened), kInvalidArgument (CheckAuthSecret), each
// naming the path.
StatusOr<std::string> ReadAuthSecretFile(const std::string& path);

// A fresh random secret: 32 random bytes as 64 hexadecimal characters. Errors: kInternal when
// the random generator fails.
StatusOr<std::string> GenerateAuthSecret();

// The secret an options struct names, else KVFERRY_AUTH_TOKEN (through ReadEnvConfig), else ""
// (none). Errors: a set but malformed KVFERRY_AUTH_TOKEN or `option` (CheckAuthSecret).
StatusOr<std::string> ResolveAuthSecret(const std::string& option);

// A fresh random nonce. Errors: kInternal when the random generator fails.
StatusOr<AuthNonce> RandomAuthNonce();

// The proof that `role` holds `secret` in the handshake of `context` with these nonces (see
// the top of this file). An empty `secret` gives the proof of "no secret".
AuthProof HandshakeProof(const std::string& secret, AuthContext context, AuthRole role,
                         const AuthNonce& client_nonce, const AuthNonce& server_nonce);

// Whether `got` equals `want`, compared in constant time.
bool ProofMatches(std::span<const uint8_t> got, const AuthProof& want);

// The HTTP bearer token of `secret`; "" when `secret` is empty.
std::string HttpBearerToken(const std::string& secret);

// Whether the value of an HTTP Authorization header is "Bearer <token>", the token compared in
// constant time. False when `token` is empty.
bool BearerMatches(const std::string& authorization, const std::string& token);

// Whether `host` names this machine's loopback interface: "localhost", 127.0.0.0/8 or ::1.
bool IsLoopbackHost(const std::string& host);

// Listening on a non-loopback `host` without a secret is refused unless `insecure`.
// `what` names the server ("engine", "bootstrap server", "control server"). Errors:
// kFailedPrecondition naming the server, the host and the ways out.
Status CheckListenSecurity(const std::string& what, const std::string& host, bool has_secret,
                           bool insecure);

}  // namespace kvferry
