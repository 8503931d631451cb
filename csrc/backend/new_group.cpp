// torch_tp::new_group and destroy_group (<torch_tp/backend.h>): a "torch_tp"
// process group made and registered from C++, the work that
// torch_tp/backend.py and torch.distributed do for a Python program.

#include <torch_tp/backend.h>

#include "backend/process_group_shm.h"

#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <vector>

namespace torch_tp {

c10::intrusive_ptr<c10d::ProcessGroup> new_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                 int world_size, const std::string& group_name,
                                                 const GroupOptions& options) {
  TORCH_CHECK(store, "torch_tp::new_group: store is null");
  TORCH_CHECK(world_size >= 1, "torch_tp::new_group: world_size=", world_size, " must be at least 1");
  TORCH_CHECK(rank >= 0 && rank < world_size, "torch_tp::new_group: rank=", rank, " is not in [0, world_size=",
              world_size, ")");
  TORCH_CHECK(!group_name.empty(), "torch_tp::new_group: group_name is empty");
  TORCH_CHECK(options.timeout.count() > 0, "torch_tp::new_group: timeout=", options.timeout.count(),
              " ms must be positive");
  // The group's own key space: the host keys, the backend's segment token.
  auto group_store = c10::make_intrusive<c10d::PrefixStore>("torch_tp/" + group_name, store);

  std::vector<std::string> hosts = backend::exchange_host_keys(group_store, rank, world_size, options.timeout);
  for (const auto r : c10::irange(world_size)) {
    TORCH_CHECK(hosts[r] == hosts[0], "torch_tp::new_group: group '", group_name, "' spans nodes: rank 0 is on '",
                hosts[0], "' and rank ", r, " on '", hosts[r],
                "'. From C++ a torch_tp group stays inside one node; across nodes, "
                "dist.init_process_group(\"torch_tp\") in Python adds gloo between them");
  }

  backend::ProcessGroupShm::Options shm_options;
  shm_options.timeout = options.timeout;
  shm_options.buffer_bytes = options.buffer_bytes.value_or(backend::buffer_bytes_from_env());
  shm_options.host_keys = std::move(hosts);
  auto shm = c10::make_intrusive<backend::ProcessGroupShm>(group_store, rank, world_size, std::move(shm_options));

  // CPU tensors go to the shared-memory backend, as torch.distributed routes
  // them for a group created with backend="torch_tp".
  auto group = c10::make_intrusive<c10d::ProcessGroup>(group_store, rank, world_size);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, shm);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  group->setGroupName(group_name);  // after setBackend: it names the backend too
  c10d::register_process_group(group_name, group);
  return group;
}

void destroy_group(const std::string& group_name) {
  const auto group = c10d::resolve_process_group(group_name);
  c10d::unregister_process_group(group_name);
  group->shutdown();
}

} // namespace torch_tp
