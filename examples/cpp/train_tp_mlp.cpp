// Trains a tensor-parallel MLP on N processes with no Python, and checks every
// step against the unsharded MLP trained in the same program.
//
//   torchrun --nproc-per-node 2 --no-python ./train_tp_mlp [--steps N] [--hidden H]
//
// torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the ranks meet
// in the TCPStore there and make a torch_tp shared-memory group ("tp"). Every
// rank builds the same full MLP (same seed), keeps its shards of it in
// torch_tp::nn modules (Megatron's column- then row-parallel pair, the column
// layer with GELU fused into it), and trains both with AdamW on the same batches. After every step the loss and every
// shard must equal the unsharded model's (within kTolerance), or the program
// exits with status 1 naming what differed.

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch_tp/backend.h>
#include <torch_tp/nn.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>

namespace {

// float64 throughout: the sharded and the unsharded MLP then differ only in
// the order in which partial sums over ranks are added (rounding near 1e-16),
// which AdamW's update over tens of steps keeps far below this.
constexpr double kTolerance = 1e-10;
constexpr int64_t kInFeatures = 16;
constexpr int64_t kOutFeatures = 8;
constexpr int64_t kBatch = 12;

const char* kUsage =
    "usage: torchrun --nproc-per-node N --no-python train_tp_mlp [--steps S] [--hidden H]\n"
    "Trains a tensor-parallel MLP (column- then row-parallel linear, torch_tp's C++ API) on N\n"
    "processes and checks every step against the unsharded MLP. Defaults: --steps 20 --hidden 40.\n";

int64_t env_int(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    throw std::runtime_error(std::string("train_tp_mlp: ") + name +
                             " is not set; launch with torchrun --nproc-per-node 2 --no-python train_tp_mlp");
  }
  return std::stoll(value);
}

// The store torchrun's agent already serves at MASTER_ADDR:MASTER_PORT (as
// torch.distributed's env:// rendezvous finds it), or one that rank 0 hosts.
c10::intrusive_ptr<c10d::Store> rendezvous(int rank, int world_size) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(env_int("MASTER_PORT"));
  options.numWorkers = world_size;
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  options.isServer = rank == 0 && !(agent_store != nullptr && std::strcmp(agent_store, "True") == 0);
  options.timeout = std::chrono::seconds(60);
  const char* addr = std::getenv("MASTER_ADDR");
  return c10::make_intrusive<c10d::TCPStore>(addr != nullptr ? addr : "127.0.0.1", options);
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what, int64_t step) {
  const double diff = actual.numel() == 0 ? 0.0 : (actual - expected).abs().max().item<double>();
  if (!(diff <= kTolerance)) {
    throw std::runtime_error("train_tp_mlp: step " + std::to_string(step) + ": " + what +
                             " differs from the unsharded MLP's by " + std::to_string(diff) + " (tolerance " +
                             std::to_string(kTolerance) + ")");
  }
}

} // namespace

int main(int argc, char** argv) {
  int64_t steps = 20;
  int64_t hidden = 40;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if ((arg == "--steps" || arg == "--hidden") && i + 1 < argc) {
      (arg == "--steps" ? steps : hidden) = std::stoll(argv[++i]);
    } else {
      std::cerr << "train_tp_mlp: unknown argument " << arg << "\n" << kUsage;
      return 2;
    }
  }

  try {
    const int rank = static_cast<int>(env_int("RANK"));
    const int world_size = static_cast<int>(env_int("WORLD_SIZE"));
    auto store = rendezvous(rank, world_size);
    // The registry holds groups weakly: "tp" names the group while `tp` lives.
    const auto tp = torch_tp::new_group(store, rank, world_size, "tp");

    // The same full MLP on every rank.
    torch::manual_seed(0);
    torch::nn::Linear up(kInFeatures, hidden), down(hidden, kOutFeatures);
    up->to(torch::kFloat64);
    down->to(torch::kFloat64);

    // This rank's shards: up's rows (hidden units), with the MLP's GELU
    // (tanh approximation) fused into the layer; down's columns.
    torch_tp::nn::ColumnParallelLinear up_tp(up, "tp", /*gather_dim=*/std::nullopt, /*activation=*/"gelu_tanh");
    torch_tp::nn::RowParallelLinear down_tp(down, "tp");

    std::vector<at::Tensor> full_params = up->parameters();
    for (const auto& p : down->parameters()) {
      full_params.push_back(p);
    }
    std::vector<at::Tensor> tp_params = up_tp->parameters();
    for (const auto& p : down_tp->parameters()) {
      tp_params.push_back(p);
    }
    torch::optim::AdamW full_optimizer(full_params, torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW tp_optimizer(tp_params, torch::optim::AdamWOptions(1e-2));

    if (rank == 0) {
      std::cout << "train_tp_mlp: " << world_size << " ranks, MLP " << kInFeatures << " -> " << hidden << " -> "
                << kOutFeatures << ", rank 0 holds " << up_tp->weight.size(0) << " hidden units\n";
    }
    for (int64_t step = 1; step <= steps; ++step) {
      // The same batch on every rank (replicated input, as tensor parallelism wants).
      torch::manual_seed(1000 + step);
      const at::Tensor x = torch::randn({kBatch, kInFeatures}, torch::kFloat64);
      const at::Tensor target = torch::randn({kBatch, kOutFeatures}, torch::kFloat64);

      full_optimizer.zero_grad();
      const at::Tensor full_loss = torch::mse_loss(down(torch::gelu(up(x), "tanh")), target);
      full_loss.backward();
      full_optimizer.step();

      tp_optimizer.zero_grad();
      const at::Tensor tp_loss = torch::mse_loss(down_tp(up_tp(x)), target);
      tp_loss.backward();
      tp_optimizer.step();

      expect_close(tp_loss, full_loss, "loss", step);
      expect_close(up_tp->weight, torch_tp::nn::shard(up->weight, 0, "tp"), "up.weight shard", step);
      expect_close(up_tp->bias, torch_tp::nn::shard(up->bias, 0, "tp"), "up.bias shard", step);
      expect_close(down_tp->weight, torch_tp::nn::shard(down->weight, 1, "tp"), "down.weight shard", step);
      expect_close(down_tp->bias, down->bias, "down.bias", step);
      if (rank == 0) {
        std::cout << "step " << step << "/" << steps << "  loss " << tp_loss.item<double>() << "  (unsharded "
                  << full_loss.item<double>() << ")\n";
      }
    }
    torch_tp::destroy_group("tp");
    if (rank == 0) {
      std::cout << "train_tp_mlp: " << steps << " steps, loss and every shard equal to the unsharded MLP within "
                << kTolerance << "\n";
    }
    return 0;
  } catch (const std::exception& error) {
    std::cerr << error.what() << "\n";
    return 1;
  }
}
