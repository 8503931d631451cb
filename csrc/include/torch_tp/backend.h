#pragma once
// torch_tp's shared-memory process group, created from C++ (no Python): the
// "torch_tp" backend of csrc/backend wrapped in a c10d::ProcessGroup and
// registered in c10d's group registry, so the ops (<torch_tp/ops.h>) and the
// modules (<torch_tp/nn.h>) find it by name, as they find the groups that
// torch.distributed creates in Python.
//
//   auto store = c10::make_intrusive<c10d::TCPStore>(master_addr, store_options);
//   auto tp = torch_tp::new_group(store, rank, world_size, "tp");  // keep it alive
//   at::Tensor y = torch_tp::all_reduce(x, "sum", "tp");
//   ...
//   torch_tp::destroy_group("tp");

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>

namespace torch_tp {

struct GroupOptions {
  // Bounds every wait: a peer that died or stopped calling is an error naming
  // the op and the rank after this long. c10d's default for CPU backends.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // Each rank's shared data buffer; unset: TORCH_TP_SHM_BUFFER_BYTES, or 2 MiB.
  std::optional<size_t> buffer_bytes;
};

// Creates the group and registers it under group_name. Every rank of the
// group calls it, with the same store, world_size and group_name (the name
// scopes the group's keys in the store, so several groups can share one).
// c10d's registry holds groups weakly: the name resolves while the returned
// pointer (or a copy of it) is alive.
//
// The ranks must be on one node: their host keys (TORCH_TP_HOST_KEY, or the
// hostname) are compared through the store, and a group that spans nodes is
// refused. Across nodes the backend needs gloo between the node leaders,
// which only torch_tp's Python factory can build (the torch wheel ships no
// gloo headers); dist.init_process_group("torch_tp") does that.
c10::intrusive_ptr<c10d::ProcessGroup> new_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                 int world_size, const std::string& group_name,
                                                 const GroupOptions& options = {});

// Shuts the group's backend down (its worker threads stop, anything queued
// fails) and removes the group from the registry.
void destroy_group(const std::string& group_name);

} // namespace torch_tp
