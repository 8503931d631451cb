#pragma once
// Assertions shared by the GoogleTest files: exact comparison of tensors, and
// "this call throws a c10::Error saying ...".

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>

namespace torch_tp::testing {

inline bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// Same dtype, same sizes, same values.
inline ::testing::AssertionResult equal_exactly(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type()) {
    return ::testing::AssertionFailure() << "dtype " << actual.scalar_type() << ", expected "
                                         << expected.scalar_type();
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << "sizes " << actual.sizes() << ", expected " << expected.sizes();
  }
  if (!at::equal(actual, expected)) {
    return ::testing::AssertionFailure() << "values differ\nactual:\n" << actual << "\nexpected:\n" << expected;
  }
  return ::testing::AssertionSuccess();
}

// Succeeds when call() throws a c10::Error whose message contains every one of `needles`.
inline ::testing::AssertionResult throws_with(const std::function<void()>& call,
                                              std::initializer_list<std::string> needles) {
  try {
    call();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& needle : needles) {
      if (!contains(message, needle)) {
        return ::testing::AssertionFailure() << "the error lacks \"" << needle << "\": " << message;
      }
    }
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "no c10::Error was thrown";
}

} // namespace torch_tp::testing
