// The authentication primitives (common/auth.h): what each proof binds, constant-time
// compares, bearer tokens, secrets from files and the environment, and which listen addresses
// need a secret.
#include "common/auth.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include "common/env.h"

namespace kvferry {
namespace {

const std::string kSecret = "a secret of more than 16 bytes";

// A proof changes with every input: the secret, the protocol, the side and either nonce. So a
// proof of one side, protocol or connection is worth nothing on another.
TEST(AuthTest, ProofsBindSecretContextRoleAndBothNonces) {
  AuthNonce a{}, b{};
  a[0] = 1;
  b[0] = 2;
  const AuthProof base = HandshakeProof(kSecret, AuthContext::kEngine, AuthRole::kClient, a, b);
  std::set<AuthProof> seen = {base};
  seen.insert(
      HandshakeProof("another secret of 20 b", AuthContext::kEngine, AuthRole::kClient, a, b));
  seen.insert(HandshakeProof("", AuthContext::kEngine, AuthRole::kClient, a, b));
  seen.insert(HandshakeProof(kSecret, AuthContext::kFdSocket, AuthRole::kClient, a, b));
  seen.insert(HandshakeProof(kSecret, AuthContext::kEngine, AuthRole::kServer, a, b));
  seen.insert(HandshakeProof(kSecret, AuthContext::kEngine, AuthRole::kClient, b, a));
  seen.insert(HandshakeProof(kSecret, AuthContext::kEngine, AuthRole::kClient, a, a));
  EXPECT_EQ(seen.size(), 7u);
  // Deterministic: the other side computes the same.
  EXPECT_EQ(base, HandshakeProof(kSecret, AuthContext::kEngine, AuthRole::kClient, a, b));
  EXPECT_TRUE(ProofMatches(base, base));
  AuthProof flipped = base;
  flipped[31] ^= 1;
  EXPECT_FALSE(ProofMatches(flipped, base));
  EXPECT_FALSE(ProofMatches(std::span(base).first(16), base));
}

TEST(AuthTest, NoncesAndGeneratedSecretsAreFresh) {
  auto n1 = RandomAuthNonce(), n2 = RandomAuthNonce();
  ASSERT_TRUE(n1.ok() && n2.ok());
  EXPECT_NE(*n1, *n2);
  auto s1 = GenerateAuthSecret(), s2 = GenerateAuthSecret();
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_EQ(s1->size(), 64u);
  EXPECT_NE(*s1, *s2);
  EXPECT_TRUE(CheckAuthSecret(*s1, "generated").ok());
}

// The bearer token is derived: it does not contain the secret, differs per secret, and only
// "Bearer <token>" exactly matches.
TEST(AuthTest, BearerTokensAreDerivedAndMatchExactly) {
  const std::string token = HttpBearerToken(kSecret);
  EXPECT_EQ(token.size(), 64u);
  EXPECT_EQ(token.find(kSecret), std::string::npos);
  EXPECT_NE(token, HttpBearerToken("another secret of 20 b"));
  EXPECT_EQ(HttpBearerToken(""), "");
  EXPECT_TRUE(BearerMatches("Bearer " + token, token));
  EXPECT_FALSE(BearerMatches("Bearer " + token + "x", token));
  EXPECT_FALSE(BearerMatches("Bearer " + token.substr(1), token));
  EXPECT_FALSE(BearerMatches("Basic " + token, token));
  EXPECT_FALSE(BearerMatches("Bearer " + kSecret, token));
  EXPECT_FALSE(BearerMatches("", token));
  EXPECT_FALSE(BearerMatches("Bearer ", ""));  // no secret: nothing matches
}

TEST(AuthTest, LoopbackHostsAndListenChecks) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "10.0.0.1", "::", "example.com", "128.0.0.1", ""}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
  EXPECT_TRUE(CheckListenSecurity("engine", "127.0.0.1", false, false).ok());
  Status refused = CheckListenSecurity("engine", "0.0.0.0", false, false);
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("engine"), std::string::npos);
  EXPECT_NE(refused.message().find("--insecure"), std::string::npos);
  EXPECT_TRUE(CheckListenSecurity("engine", "0.0.0.0", true, false).ok());
  EXPECT_TRUE(CheckListenSecurity("engine", "0.0.0.0", false, true).ok());
}

// Files: trailing newlines dropped; missing, short files refused by name, never quoting the
// secret.
TEST(AuthTest, SecretFiles) {
  const std::string path =
      ::testing::TempDir() + "kvferry-auth-secret-" + std::to_string(::getpid());
  std::ofstream(path) << kSecret << "\n";
  auto read = ReadAuthSecretFile(path);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, kSecret);
  std::ofstream(path) << "tiny\n";
  auto tiny = ReadAuthSecretFile(path);
  ASSERT_FALSE(tiny.ok());
  EXPECT_EQ(tiny.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tiny.status().message().find(path), std::string::npos);
  EXPECT_EQ(tiny.status().message().find("tiny"), std::string::npos) << tiny.status().ToString();
  ::unlink(path.c_str());
  auto missing = ReadAuthSecretFile(path);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

// KVFERRY_AUTH_TOKEN through ReadEnvConfig and ResolveAuthSecret: an option wins, a short
// token is an error naming the variable and not the value.
TEST(AuthTest, EnvironmentToken) {
  ::setenv("KVFERRY_AUTH_TOKEN", kSecret.c_str(), 1);
  auto env = ReadEnvConfig();
  ASSERT_TRUE(env.ok());
  EXPECT_EQ(env->auth_token, kSecret);
  EXPECT_EQ(*ResolveAuthSecret(""), kSecret);
  EXPECT_EQ(*ResolveAuthSecret("an option secret, 24 b"), "an option secret, 24 b");
  ::setenv("KVFERRY_AUTH_TOKEN", "hunter2", 1);
  auto bad = ReadEnvConfig();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("KVFERRY_AUTH_TOKEN"), std::string::npos);
  EXPECT_EQ(bad.status().message().find("hunter2"), std::string::npos);
  ::unsetenv("KVFERRY_AUTH_TOKEN");
  EXPECT_EQ(*ResolveAuthSecret(""), "");
}

}  // namespace
}  // namespace kvferry
