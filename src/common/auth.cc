#include "common/auth.h"

#include <arpa/inet.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cctype>
#include <fstream>
#include <iterator>
#include <string_view>

#include "common/checks.h"
#include "common/env.h"

namespace kvferry {
namespace {

constexpr std::string_view kHandshakeKeyLabel = "kvferry handshake key v1";
constexpr std::string_view kProofLabel = "kvferry-auth-v1";
constexpr std::string_view kBearerLabel = "kvferry http bearer v1";

// HMAC-SHA256 of `data` under `key` (an empty key is allowed).
AuthProof Hmac(std::span<const uint8_t> key, std::span<const uint8_t> data) {
  static const uint8_t kNoKey = 0;
  AuthProof out{};
  unsigned int out_len = 0;
  ::HMAC(EVP_sha256(), key.empty() ? &kNoKey : key.data(), static_cast<int>(key.size()),
         data.data(), data.size(), out.data(), &out_len);
  return out;
}

std::span<const uint8_t> Bytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

std::string Hex(std::span<const uint8_t> bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

}  // namespace

Status CheckAuthSecret(const std::string& secret, const std::string& source) {
  if (secret.size() < kMinAuthSecretBytes) {
    return InvalidArgumentError(source + " holds " + std::to_string(secret.size()) +
                                " bytes: an auth secret needs at least " +
                                std::to_string(kMinAuthSecretBytes));
  }
  if (secret.size() > kMaxAuthSecretBytes) {
    return InvalidArgumentError(source + " holds " + std::to_string(secret.size()) +
                                " bytes: an auth secret may have at most " +
                                std::to_string(kMaxAuthSecretBytes));
  }
  return OkStatus();
}

StatusOr<std::string> ReadAuthSecretFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError("--auth-token-file " + path + ": cannot be opened");
  std::string secret;
  char buf[4096];
  while (in.read(buf, sizeof(buf)) || in.gcount() > 0) {
    secret.append(buf, static_cast<size_t>(in.gcount()));
    if (secret.size() > kMaxAuthSecretBytes + 64) break;  // far too long: refused below
  }
  while (!secret.empty() && std::isspace(static_cast<unsigned char>(secret.back()))) {
    secret.pop_back();
  }
  RETURN_IF_ERROR(CheckAuthSecret(secret, "--auth-token-file " + path));
  return secret;
}

StatusOr<std::string> GenerateAuthSecret() {
  std::array<uint8_t, 32> bytes{};
  if (::RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) {
    return InternalError("RAND_bytes failed to generate an auth secret");
  }
  return Hex(bytes);
}

StatusOr<std::string> ResolveAuthSecret(const std::string& option) {
  if (!option.empty()) {
    RETURN_IF_ERROR(CheckAuthSecret(option, "the auth secret option"));
    return option;
  }
  ASSIGN_OR_RETURN(EnvConfig env, ReadEnvConfig());
  return env.auth_token.value_or(std::string());
}

StatusOr<AuthNonce> RandomAuthNonce() {
  AuthNonce nonce{};
  if (::RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) != 1) {
    return InternalError("RAND_bytes failed to generate a handshake nonce");
  }
  return nonce;
}

AuthProof HandshakeProof(const std::string& secret, AuthContext context, AuthRole role,
                         const AuthNonce& client_nonce, const AuthNonce& server_nonce) {
  const AuthProof key = Hmac(Bytes(secret), Bytes(kHandshakeKeyLabel));
  std::array<uint8_t, kProofLabel.size() + 2 + 2 * kAuthNonceBytes> message{};
  size_t at = 0;
  for (char c : kProofLabel) message[at++] = static_cast<uint8_t>(c);
  message[at++] = static_cast<uint8_t>(context);
  message[at++] = static_cast<uint8_t>(role);
  for (uint8_t b : client_nonce) message[at++] = b;
  for (uint8_t b : server_nonce) message[at++] = b;
  return Hmac(key, message);
}

bool ProofMatches(std::span<const uint8_t> got, const AuthProof& want) {
  return got.size() == want.size() && ::CRYPTO_memcmp(got.data(), want.data(), want.size()) == 0;
}

std::string HttpBearerToken(const std::string& secret) {
  if (secret.empty()) return "";
  return Hex(Hmac(Bytes(secret), Bytes(kBearerLabel)));
}

bool BearerMatches(const std::string& authorization, const std::string& token) {
  constexpr std::string_view kScheme = "Bearer ";
  if (token.empty() || authorization.size() != kScheme.size() + token.size()) return false;
  if (authorization.compare(0, kScheme.size(), kScheme) != 0) return false;
  return ::CRYPTO_memcmp(authorization.data() + kScheme.size(), token.data(), token.size()) == 0;
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  in6_addr v6{};
  if (::inet_pton(AF_INET6, bare.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6) != 0;
  }
  return false;
}

Status CheckListenSecurity(const std::string& what, const std::string& host, bool has_secret,
                           bool insecure) {
  if (has_secret || insecure || IsLoopbackHost(host)) return OkStatus();
  return FailedPreconditionError(
      "refusing to let the " + what + " listen on " + host +
      " (not loopback) without an auth secret: anyone who reaches it could read and write "
      "registered memory or drive the instance. Set KVFERRY_AUTH_TOKEN or --auth-token-file on "
      "every process, or pass --insecure (EngineOptions::insecure) to accept that");
}

}  // namespace kvferry
