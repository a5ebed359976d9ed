// Hex digits to bytes: keys travel from Python as hex (the engine key of EngineConfig::auth_key).
#pragma once

#include <string>

#include "core/errors.hpp"

namespace weightsync {

// Throws TransportError on an odd number of digits or a character that is not one.
inline std::string unhex(const std::string& hex) {
  auto val = [](char ch) -> int {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
  };
  if (hex.size() % 2) throw TransportError("engine key: odd number of hex digits");
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = val(hex[i]), lo = val(hex[i + 1]);
    if (hi < 0 || lo < 0) throw TransportError("engine key: not hex");
    out.push_back(char(hi << 4 | lo));
  }
  return out;
}

}  // namespace weightsync
