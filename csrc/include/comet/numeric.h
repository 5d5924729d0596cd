// fp32 <-> bf16 / fp16 conversions on raw 16-bit patterns, identical on host and device, so the CPU
// backend rounds exactly like the CUDA epilogues (round to nearest even, NaN kept NaN).
#pragma once

#include <cstring>

#include "comet/config.h"

namespace comet {

COMET_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

COMET_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

COMET_HD float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

COMET_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                        // round to nearest even
  return uint16_t(u >> 16);
}

COMET_HD float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: value = man * 2^-24
    float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

COMET_HD uint16_t float_to_f16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                   // below 2^-14: subnormal or zero
    // value / 2^-24 rounded to nearest even integer gives the subnormal mantissa
    float v = bits_float(a) * 16777216.0f;
    uint32_t m = uint32_t(v);
    float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  uint32_t exp = (a >> 23) - 112u;
  uint32_t man = a & 0x7fffffu;
  uint32_t h = (exp << 10) | (man >> 13);
  uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent: correct
  return uint16_t(sign | h);
}

// float8_e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinity, S.1111.111 is
// NaN) widened exactly to fp32.
COMET_HD float fp8e4m3_to_float(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu, man = b & 0x7u;
  if (exp == 15 && man == 7) return bits_float(sign | 0x7fc00000u);
  if (exp == 0) {  // subnormal: man * 2^-9
    const float v = float(man) * 0.001953125f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// Load element i of a buffer of `kind` in the accumulator type Acc (float, or double for F64).
template <class Acc>
COMET_HD Acc load_as(const void* p, int64_t i, ScalarKind kind) {
  if (kind == ScalarKind::F64) return Acc(static_cast<const double*>(p)[i]);
  if (kind == ScalarKind::F32) return Acc(static_cast<const float*>(p)[i]);
  if (kind == ScalarKind::F8E4M3) return Acc(fp8e4m3_to_float(static_cast<const uint8_t*>(p)[i]));
  uint16_t b = static_cast<const uint16_t*>(p)[i];
  return Acc(kind == ScalarKind::BF16 ? bf16_to_float(b) : f16_to_float(b));
}

// Store an accumulator value as element i of a buffer of `kind` (rounding to nearest even).
template <class Acc>
COMET_HD void store_as(void* p, int64_t i, ScalarKind kind, Acc v) {
  if (kind == ScalarKind::F64) {
    static_cast<double*>(p)[i] = double(v);
  } else if (kind == ScalarKind::F32) {
    static_cast<float*>(p)[i] = float(v);
  } else {
    const float f = float(v);
    static_cast<uint16_t*>(p)[i] = kind == ScalarKind::BF16 ? float_to_bf16(f) : float_to_f16(f);
  }
}

}  // namespace comet
