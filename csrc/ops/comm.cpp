#include "ops/comm.h"

#include "backend/dense.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/accumulate.h>
#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/debug.h>
#include <torch/version.h>
#include <torch_tp/direct_collectives.h>

namespace torch_tp {
namespace {

// The one door from this file to c10d's collectives: each hands the engine
// aliases of its tensors (NOTE [what a backend's threads may hold]), so no
// engine thread ever holds a TensorImpl Python wraps. ProcessGroup renamed
// _allgather_base/_reduce_scatter_base to all_gather_single/reduce_scatter_single
// in torch 2.13 and deprecated the old names.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define TORCH_TP_SINGLE_TENSOR_NAMES 1
#else
#define TORCH_TP_SINGLE_TENSOR_NAMES 0
#endif

c10::intrusive_ptr<c10d::Work> all_reduce_into(c10d::ProcessGroup& group, const at::Tensor& tensor,
                                               const c10d::AllreduceOptions& opts) {
  std::vector<at::Tensor> tensors{backend::alias_for_backend(tensor)};
  return group.allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> all_gather_into(c10d::ProcessGroup& group, const at::Tensor& out, const at::Tensor& in,
                                               const c10d::AllgatherOptions& opts) {
  at::Tensor engine_out = backend::alias_for_backend(out);
  at::Tensor engine_in = backend::alias_for_backend(in);
#if TORCH_TP_SINGLE_TENSOR_NAMES
  return group.all_gather_single(engine_out, engine_in, opts);
#else
  return group._allgather_base(engine_out, engine_in, opts);
#endif
}

c10::intrusive_ptr<c10d::Work> reduce_scatter_into(c10d::ProcessGroup& group, const at::Tensor& out,
                                                   const at::Tensor& in, const c10d::ReduceScatterOptions& opts) {
  at::Tensor engine_out = backend::alias_for_backend(out);
  at::Tensor engine_in = backend::alias_for_backend(in);
#if TORCH_TP_SINGLE_TENSOR_NAMES
  return group.reduce_scatter_single(engine_out, engine_in, opts);
#else
  return group._reduce_scatter_base(engine_out, engine_in, opts);
#endif
}

c10::intrusive_ptr<c10d::Work> all_to_all_into(c10d::ProcessGroup& group, const at::Tensor& out, const at::Tensor& in,
                                               std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) {
  at::Tensor engine_out = backend::alias_for_backend(out);
  at::Tensor engine_in = backend::alias_for_backend(in);
#if TORCH_TP_SINGLE_TENSOR_NAMES
  return group.all_to_all_single(engine_out, engine_in, output_splits, input_splits, opts);
#else
  return group.alltoall_base(engine_out, engine_in, output_splits, input_splits, opts);
#endif
}

c10::intrusive_ptr<c10d::Work> all_to_all_into(c10d::ProcessGroup& group, const at::Tensor& out, const at::Tensor& in,
                                               const c10d::AllToAllOptions& opts) {
  std::vector<int64_t> equal_splits;
  return all_to_all_into(group, out, in, equal_splits, equal_splits, opts);
}

// NOTE [rank blocks without moving the dim to the front]
// A collective along dim d of x [outer.., s, inner..] works on x as three
// dims [outer, s, inner] (outer: the product of the sizes before d, inner:
// of those after it), which is a view of a contiguous x. The backends gather
// and scatter along dim 0, in rank-major blocks [p * outer, c, inner] (c:
// the torch.chunk rows per rank, c * p >= n, zero rows past n):
//   all-gather:     each rank's x as it is, [outer, c, inner] -> blocks
//                   [p, outer, c, inner] -> one permuted copy to
//                   [outer, p * c, inner], the first n rows of dim 1;
//   reduce-scatter: one permuted copy of x [outer, p * c, inner] to blocks
//                   [p, outer, c, inner] -> this rank's reduced block
//                   [outer, c, inner], already x's layout.
// One copy per call, where moving d to the front and back again copied the
// input and the output (two movedim().contiguous()); the sequence-parallel
// gathers and reduce-scatters of [b, s, h] along s are that case. With
// d = 0 (outer = 1) the blocks are x itself and nothing is copied, as before.
// Uneven pieces add a copy for the zero rows.
// A backend with direct calls (<torch_tp/direct_collectives.h>) takes the
// [outer, c, inner] and [outer, p * c, inner] views themselves and moves each
// rank's piece as its `outer` runs, so there is no permuted copy at all: the
// torch_tp backend copies the runs to and from its shared buffers, which it
// copies through anyway, so a sequence-dim all-gather or reduce-scatter
// costs no more copying than a dim-0 one.

// x [.., s, ..] as [outer, rows, inner], contiguous: x's own s rows along
// dim, then zero rows up to `rows`.
at::Tensor padded_blocks(const at::Tensor& x, int64_t dim, int64_t rows) {
  const int64_t outer = c10::multiply_integers(x.sizes().slice(0, dim));
  const int64_t inner = c10::multiply_integers(x.sizes().slice(dim + 1));
  at::Tensor x3 = x.reshape({outer, x.size(dim), inner});
  if (x3.size(1) == rows) {
    return x3.contiguous();
  }
  at::Tensor padded = at::zeros({outer, rows, inner}, x.options());
  padded.narrow(1, 0, x3.size(1)).copy_(x3);
  return padded;
}

// [outer, p * c, inner] <-> rank-major blocks [p * outer, c, inner]: block r
// holds rows [r * c, (r + 1) * c) of dim 1. A view when outer is 1, else a copy.
at::Tensor to_rank_major(const at::Tensor& rows, int64_t world_size) {
  const int64_t outer = rows.size(0);
  const int64_t chunk = rows.size(1) / world_size;
  const int64_t inner = rows.size(2);
  if (outer == 1) {
    return rows.view({world_size, chunk, inner});
  }
  return rows.view({outer, world_size, chunk, inner}).permute({1, 0, 2, 3}).reshape({world_size * outer, chunk, inner});
}

at::Tensor from_rank_major(const at::Tensor& blocks, int64_t world_size) {
  const int64_t outer = blocks.size(0) / world_size;
  const int64_t chunk = blocks.size(1);
  const int64_t inner = blocks.size(2);
  if (outer == 1) {
    return blocks.view({1, world_size * chunk, inner});
  }
  return blocks.view({world_size, outer, chunk, inner}).permute({1, 0, 2, 3}).reshape({outer, world_size * chunk, inner});
}

// rows [outer, m, inner] -> the first `n` of its m rows in x's dims, with n rows along dim, contiguous.
at::Tensor first_rows_as(const at::Tensor& rows, int64_t n, const at::Tensor& x, int64_t dim) {
  auto sizes = x.sizes().vec();
  sizes[dim] = n;
  const at::Tensor first = n == rows.size(1) ? rows : rows.narrow(1, 0, n);
  return first.reshape(sizes).contiguous();
}

// The backend that serves x's device on `group`; null when the group has
// none (the c10d call then reports it).
c10d::Backend* backend_for(c10d::ProcessGroup& group, const at::Tensor& x) {
  try {
    return group.getBackend(x.device().type()).get();
  } catch (const c10::Error&) {
    return nullptr;
  }
}

// The backend's direct calls if it offers them and the caller waits at once
// (NOTE [direct calls from the ops] in <torch_tp/direct_collectives.h>), or
// starts the call to overlap it where the backend has no core to overlap it
// on (NOTE [async calls without a core to run on]), else null: the call goes
// through c10d. Avg reaches them as SUM (to_c10d), and the caller divides,
// as on every backend.
DirectCollectives* direct_calls(c10d::Backend* backend, bool async_op) {
  auto* direct = dynamic_cast<DirectCollectives*>(backend);
  return direct != nullptr && (!async_op || !direct->overlaps_async_calls()) ? direct : nullptr;
}

// The context a backend's failure is rethrown with: the op, the group, x, and
// the dim argument where the op has one.
std::string failure_context(const char* op, c10d::ProcessGroup& group, const at::Tensor& x,
                            const char* dim_arg = nullptr, int64_t dim = 0) {
  return c10::str(op, ": the ", group.getBackendName(), " backend of group '", group.getGroupName(),
                  "' failed on x of dtype ", x.scalar_type(), " and shape ", x.sizes(),
                  dim_arg == nullptr ? "" : c10::str(" with ", dim_arg, "=", dim));
}

// Wraps the start of a collective: a failure while launching is reported like
// one while waiting, with the dim argument too where there is one.
template <typename Launch>
c10::intrusive_ptr<c10d::Work> launch(const char* op, c10d::ProcessGroup& group, const at::Tensor& x, Launch&& start,
                                      const char* dim_arg = nullptr, int64_t dim = 0) {
  try {
    return start();
  } catch (c10::Error& e) {
    e.add_context(failure_context(op, group, x, dim_arg, dim));
    throw;
  }
}

// NOTE [reduce-scatter on gloo]
// gloo's reduce_scatter on CPU tensors runs a whole all_reduce (DTensor's
// profile shows it), so it costs more than gloo's own all_to_all of the same
// tensor. On gloo a reduce-scatter is therefore reduce_scatter_by_all_to_all:
// an all_to_all that hands every rank the p blocks of its piece, [p*c, rest]
// -> [p, c, rest], and a local fold over the p blocks in rank order. The sum
// is the same bitwise wherever the fold order does not matter (2 ranks,
// integers, min, max); for more ranks it is a different order of the same
// additions, within float roundoff of gloo's (bfloat16 and float16 are
// folded in float32 by at::sum and rounded once, more precisely than gloo
// does). It is faster than c10d's reduce_scatter on gloo at every size
// benchmarks/bench_collectives.py measures: the reduce_scatter rows of
// benchmarks/RESULTS.md, "Collectives: torch_tp vs functional collectives vs
// raw c10d" (measurements live there, where they are rerun, not here).
// gloo is torch's backend and cannot implement an interface of ours (as
// DirectCollectives does), so this and all_to_all_pieces' messages (NOTE
// [all-to-all by pieces in messages] in comm_pieces.cpp) are the ops' two
// paths for a backend they know by the name c10d gives it.
bool is_gloo(const c10d::Backend* backend) {
  return backend != nullptr && backend->getBackendName() == "gloo";
}

// blocks [p, c, rest] -> [c, rest]: the fold of NOTE [reduce-scatter on gloo],
// in x's dtype (integers wrap as gloo's do).
at::Tensor fold_blocks(const at::Tensor& blocks, Reduction reduction) {
  switch (reduction) {
    case Reduction::Sum:
    case Reduction::Avg:  // divided by the caller
      return at::sum(blocks, {0}, false, blocks.scalar_type());
    case Reduction::Product:
      return at::prod(blocks, 0, false, blocks.scalar_type());
    case Reduction::Min:
      return at::amin(blocks, {0});
    case Reduction::Max:
      return at::amax(blocks, {0});
  }
  TORCH_INTERNAL_ASSERT(false, "unknown reduction");
}

// NOTE [reduce-scatter on gloo]: front [p*c, rest] -> all_to_all -> blocks,
// whose block r is rank r's front rows [me*c, (me+1)*c) -> fold -> [c, rest]
// -> finish_piece.
template <typename FinishPiece>
PendingCollective reduce_scatter_by_all_to_all(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                               bool async_op, const at::Tensor& x, const at::Tensor& front,
                                               Reduction reduction, FinishPiece finish_piece, const char* dim_arg,
                                               int64_t dim) {
  const int64_t world_size = group->getSize();
  at::Tensor blocks = at::empty_like(front);
  c10d::AllToAllOptions opts;
  opts.asyncOp = async_op;
  auto work = launch(op, *group, x, [&] { return all_to_all_into(*group, blocks, front, opts); }, dim_arg, dim);
  auto sizes = front.sizes().vec();
  sizes[0] /= world_size;
  sizes.insert(sizes.begin(), world_size);
  // `front` is captured to outlive the collective.
  auto finish = [blocks, front, sizes, reduction, finish_piece] {
    return finish_piece(fold_blocks(blocks.view(sizes), reduction));
  };
  return PendingCollective(std::move(work), std::move(finish), op, group, x);
}

// The value of a size, if it is known now (not a symbol of torch.compile).
std::optional<int64_t> concrete(int64_t size) {
  return size;
}
std::optional<int64_t> concrete(const c10::SymInt& size) {
  return size.maybe_as_int();
}

// FNV-1a of the op's name: the same in every process, unlike a pointer.
int64_t name_hash(const char* name) {
  uint64_t h = 1469598103934665603ull;
  for (const char* c = name; *c != '\0'; ++c) {
    h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 1);
}

} // namespace

bool cross_rank_checks_enabled() {
  return c10d::debug_level() == c10d::DebugLevel::Detail;
}

void check_same_across_ranks(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                             const at::Tensor& x, std::optional<Reduction> reduction, std::optional<int64_t> dim,
                             std::optional<int64_t> full_size, const char* dim_arg) {
  const int64_t world_size = group->getSize();
  if (world_size == 1) {
    return;
  }
  // [op, reduce_op, dim, full_size, ndim, sizes (kDims slots; the last holds
  // the product of any further sizes; -1 for the size along dim where the
  // pieces may differ)]; -1 for "not given".
  constexpr int64_t kDims = 8;
  constexpr int64_t kFields = 5 + kDims;
  std::vector<int64_t> mine(kFields, 0);
  mine[0] = name_hash(op);
  mine[1] = reduction ? static_cast<int64_t>(*reduction) : -1;
  mine[2] = dim.value_or(-1);
  mine[3] = full_size.value_or(-1);
  mine[4] = x.dim();
  for (const auto d : c10::irange(x.dim())) {
    const int64_t size = (dim && full_size && d == *dim) ? -1 : x.size(d);
    int64_t& slot = mine[5 + std::min<int64_t>(d, kDims - 1)];
    slot = d < kDims ? size : slot * size;
  }
  c10::OptionalDeviceGuard device_guard(x.device());
  at::Tensor in = at::tensor(mine, at::TensorOptions().dtype(at::kLong)).to(x.device());
  at::Tensor all = at::empty({world_size * kFields}, in.options());
  c10d::AllgatherOptions opts;
  opts.asyncOp = false;
  launch(op, *group, x, [&] { return all_gather_into(*group, all, in, opts); })->wait();
  const at::Tensor table = all.view({world_size, kFields}).cpu();
  const auto rows = table.accessor<int64_t, 2>();
  const int64_t rank = group->getRank();
  auto shape_of = [&](int64_t r) {
    std::vector<int64_t> shape;
    for (const auto d : c10::irange(std::min(rows[r][4], kDims))) {
      shape.push_back(rows[r][5 + d]);
    }
    return c10::str(at::IntArrayRef(shape));
  };
  const char* why = " (checked because TORCH_DISTRIBUTED_DEBUG=DETAIL)";
  for (const auto r : c10::irange(world_size)) {
    TORCH_CHECK(rows[r][0] == mine[0], op, ": rank ", r, " is in a different collective than rank ", rank,
                " (every rank must call the same torch_tp ops in the same order)", why);
    auto reduce_op = [](int64_t code) { return code < 0 ? "none" : reduction_name(static_cast<Reduction>(code)); };
    TORCH_CHECK(rows[r][1] == mine[1], op, ": reduce_op differs across ranks: rank ", rank, " passed '",
                reduce_op(mine[1]), "' but rank ", r, " passed '", reduce_op(rows[r][1]), "'", why);
    TORCH_CHECK(rows[r][2] == mine[2], op, ": ", dim_arg, " differs across ranks: rank ", rank, " passed ", dim_arg,
                "=", mine[2], " but rank ", r, " passed ", dim_arg, "=", rows[r][2], " (wrapped to [0, ndim))", why);
    TORCH_CHECK(rows[r][3] == mine[3], op, ": full_size differs across ranks: rank ", rank, " passed ", mine[3],
                " but rank ", r, " passed ", rows[r][3], " (-1: not given)", why);
    bool same_shape = rows[r][4] == mine[4];
    for (const auto d : c10::irange(kDims)) {
      same_shape = same_shape && rows[r][5 + d] == mine[5 + d];
    }
    TORCH_CHECK(same_shape, op, ": x has shape ", shape_of(rank), " on rank ", rank, " but ", shape_of(r), " on rank ",
                r, (dim && full_size ? " (-1: the size along " : ""), (dim && full_size ? dim_arg : ""),
                (dim && full_size ? ", which may differ)" : ""), "; the shapes must match across ranks", why);
  }
}

template <typename Int>
Int gathered_size(const char* op, const Int& local, int64_t dim, std::optional<int64_t> full_size,
                  int64_t world_size, int64_t rank) {
  if (!full_size) {
    return local * world_size;
  }
  TORCH_CHECK(*full_size >= 0, op, ": full_size=", *full_size, " must be >= 0");
  const int64_t expected = chunk_range(*full_size, world_size, rank).length;
  const std::optional<int64_t> known = concrete(local);
  TORCH_CHECK(!known || *known == expected, op, ": x.size(", dim, ")=", local, " but rank ", rank,
              "'s torch.chunk piece of full_size=", *full_size, " over ", world_size, " ranks has ", expected,
              " rows");
  return Int(*full_size);
}

template int64_t gathered_size(const char*, const int64_t&, int64_t, std::optional<int64_t>, int64_t, int64_t);
template c10::SymInt gathered_size(const char*, const c10::SymInt&, int64_t, std::optional<int64_t>, int64_t,
                                   int64_t);

PendingCollective::PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::function<at::Tensor()> finish,
                                     const char* op, c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor input)
    : work_(std::move(work)), finish_(std::move(finish)), op_(op), group_(std::move(group)), input_(std::move(input)) {}

PendingCollective::~PendingCollective() {
  if (work_) {
    try {
      work_->wait();
    } catch (...) {  // NOLINT(bugprone-empty-catch): unwinding already; the first error is the one to report
    }
  }
}

at::Tensor PendingCollective::wait() {
  if (work_) {
    auto work = std::move(work_);
    try {
      work->wait();
    } catch (c10::Error& e) {
      // Context, not a new error: a DistBackendError (timeout, dead peer) stays one.
      e.add_context(failure_context(op_, *group_, input_));
      throw;
    }
  }
  return finish_();
}

PendingCollective start_all_reduce(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   bool async_op, const at::Tensor& input, at::Tensor output, Reduction reduction) {
  TORCH_INTERNAL_ASSERT(input.is_contiguous() && output.is_contiguous());
  const int64_t world_size = group->getSize();
  if (cross_rank_checks_enabled()) {
    check_same_across_ranks(op, group, input, reduction, std::nullopt, std::nullopt, "dim");
  }
  c10::intrusive_ptr<c10d::Work> work;
  if (auto* direct = world_size > 1 ? direct_calls(backend_for(*group, input), async_op) : nullptr) {
    launch(op, *group, input, [&] {
      direct->all_reduce_now(input, output, to_c10d(reduction));
      return c10::intrusive_ptr<c10d::Work>();
    });
  } else {
    if (!output.is_same(input)) {
      output.copy_(input);
    }
    if (world_size > 1) {
      c10::OptionalDeviceGuard device_guard(output.device());
      c10d::AllreduceOptions opts;
      opts.reduceOp = to_c10d(reduction);
      opts.asyncOp = async_op;
      work = launch(op, *group, input, [&] { return all_reduce_into(*group, output, opts); });
    }
  }
  auto finish = [output, reduction, world_size]() mutable {
    if (reduction == Reduction::Avg && world_size > 1) {
      output.div_(world_size);
    }
    return output;
  };
  return PendingCollective(std::move(work), std::move(finish), op, group, input);
}

PendingCollective start_all_gather(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   bool async_op, const at::Tensor& x, int64_t dim, std::optional<int64_t> full_size,
                                   const char* dim_arg) {
  const int64_t world_size = group->getSize();
  const int64_t n = gathered_size(op, x.size(dim), dim, full_size, world_size, group->getRank());
  if (cross_rank_checks_enabled()) {
    check_same_across_ranks(op, group, x, std::nullopt, dim, full_size, dim_arg);
  }
  if (world_size == 1) {
    return PendingCollective({}, [out = x.clone(at::MemoryFormat::Contiguous)] { return out; }, op, group, x);
  }
  c10::OptionalDeviceGuard device_guard(x.device());
  // x [.., s, ..] -> front [outer, c, inner] (padded) -> gathered [p*outer, c, inner] -> [outer, p*c, inner]
  // -> the first n rows: [.., n, ..] (NOTE [rank blocks without moving the dim to the front]).
  const int64_t chunk = chunk_rows(n, world_size);
  at::Tensor front = padded_blocks(x, dim, chunk);
  if (auto* direct = direct_calls(backend_for(*group, front), async_op)) {
    at::Tensor rows = at::empty({front.size(0), world_size * chunk, front.size(2)}, front.options());
    launch(op, *group, x, [&] {
      direct->all_gather_now(front, rows, dim);
      return c10::intrusive_ptr<c10d::Work>();
    }, dim_arg, dim);
    return PendingCollective({}, [rows, n, x, dim] { return first_rows_as(rows, n, x, dim); }, op, group, x);
  }
  at::Tensor gathered = at::empty({world_size * front.size(0), chunk, front.size(2)}, front.options());
  c10d::AllgatherOptions opts;
  opts.asyncOp = async_op;
  auto work = launch(op, *group, x, [&] { return all_gather_into(*group, gathered, front, opts); }, dim_arg, dim);
  auto finish = [gathered, front, n, x, dim, world_size] {
    return first_rows_as(from_rank_major(gathered, world_size), n, x, dim);
  };
  return PendingCollective(std::move(work), std::move(finish), op, group, x);
}

PendingCollective start_reduce_scatter(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                       bool async_op, const at::Tensor& x, int64_t dim, Reduction reduction,
                                       const char* dim_arg) {
  const int64_t world_size = group->getSize();
  if (cross_rank_checks_enabled()) {
    check_same_across_ranks(op, group, x, reduction, dim, std::nullopt, dim_arg);
  }
  if (world_size == 1) {
    return PendingCollective({}, [out = x.clone(at::MemoryFormat::Contiguous)] { return out; }, op, group, x);
  }
  c10::OptionalDeviceGuard device_guard(x.device());
  // x [.., n, ..] -> [outer, p*c, inner] (zero rows appended) -> front [p*outer, c, inner] (rank-major)
  // -> piece [outer, c, inner] (rows r*c.. of the reduction) -> this rank's rows: [.., s_r, ..]
  // (NOTE [rank blocks without moving the dim to the front]).
  const int64_t n = x.size(dim);
  const int64_t chunk = chunk_rows(n, world_size);
  const int64_t length = chunk_range(n, world_size, group->getRank()).length;
  at::Tensor rows = padded_blocks(x, dim, chunk * world_size);
  auto new_piece = [&] { return at::empty({rows.size(0), chunk, rows.size(2)}, rows.options()); };
  auto finish_piece = [length, x, dim, reduction, world_size](const at::Tensor& piece) {
    if (reduction == Reduction::Avg) {
      piece.div_(world_size);  // the padding rows too: they are dropped
    }
    return first_rows_as(piece, length, x, dim);
  };
  c10d::Backend* const backend = backend_for(*group, x);
  const c10d::ReduceOp reduce_op = to_c10d(reduction);
  if (auto* direct = direct_calls(backend, async_op)) {
    at::Tensor piece = new_piece();
    launch(op, *group, x, [&] {
      direct->reduce_scatter_now(rows, piece, reduce_op, dim);
      return c10::intrusive_ptr<c10d::Work>();
    }, dim_arg, dim);
    return PendingCollective({}, [piece, finish_piece] { return finish_piece(piece); }, op, group, x);
  }
  at::Tensor front = to_rank_major(rows, world_size);
  if (is_gloo(backend)) {
    return reduce_scatter_by_all_to_all(op, group, async_op, x, front, reduction, std::move(finish_piece), dim_arg,
                                        dim);
  }
  at::Tensor piece = new_piece();
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = reduce_op;
  opts.asyncOp = async_op;
  auto work = launch(op, *group, x, [&] { return reduce_scatter_into(*group, piece, front, opts); }, dim_arg, dim);
  auto finish = [piece, front, finish_piece] { return finish_piece(piece); };
  return PendingCollective(std::move(work), std::move(finish), op, group, x);
}

PendingCollective start_all_to_all(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   bool async_op, const at::Tensor& x, std::vector<int64_t> output_splits,
                                   std::vector<int64_t> input_splits) {
  const int64_t world_size = group->getSize();
  auto sizes = x.sizes().vec();
  sizes[0] = c10::sum_integers(output_splits);
  if (world_size == 1) {
    return PendingCollective({}, [out = x.clone(at::MemoryFormat::Contiguous)] { return out; }, op, group, x);
  }
  c10::OptionalDeviceGuard device_guard(x.device());
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(sizes, in.options());
  c10d::AllToAllOptions opts;
  opts.asyncOp = async_op;
  auto work = launch(op, *group, x, [&] { return all_to_all_into(*group, out, in, output_splits, input_splits, opts); });
  // `in` is captured to outlive the collective.
  return PendingCollective(std::move(work), [out, in] { return out; }, op, group, x);
}

bool all_to_all_pieces(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& rows,
                       const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                       AllToAllPieces& pieces) {
  c10d::Backend* const backend = backend_for(*group, rows);
  try {
    if (DirectCollectives* direct = direct_calls(backend, false)) {
      return direct->all_to_all_pieces_now(rows, send_rows, recv_rows, pieces);
    }
    if (is_gloo(backend) && rows.device().is_cpu()) {
      all_to_all_pieces_in_messages(*group, rows, send_rows, recv_rows, pieces);
      return true;
    }
    return false;
  } catch (c10::Error& e) {
    e.add_context(failure_context(op, *group, rows));
    throw;
  }
}

} // namespace torch_tp
