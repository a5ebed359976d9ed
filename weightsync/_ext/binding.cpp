// The Python binding of the engine: thin on purpose. It converts arguments, releases the GIL around
// anything that can wait, and maps engine exceptions onto weightsync.errors. Descriptors, addresses and
// every policy live in the weightsync.engine package; the data plane lives in cpp/. The stub
// weightsync/_ext/_core.pyi is generated from this file (scripts/gen_stubs.sh) and checked in CI.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <optional>
#include <stdexcept>
#include <vector>

#include "cuda/cuda_lane.hpp"
#include "core/engine.hpp"
#include "delta/host_delta.hpp"
#include "cuda/imm_ring.hpp"
#include "core/errors.hpp"
#include "fabric/fabric_lane.hpp"
#include "core/log.hpp"
#include "core/pieces.hpp"

namespace nb = nanobind;
using namespace nb::literals;
namespace ws = weightsync;

namespace {

template <typename T>
using Column = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::object error_class(const char* name) {
  return nb::module_::import_("weightsync.errors").attr(name);
}

nb::bytes to_bytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

// References to Python buffers that native regions own (RegistrationHold::owner). The last reference
// to a region's memory is often dropped on a lane's worker thread (a piece the NIC released), which must
// never take the GIL: a Python thread may hold it while waiting for that very worker (LaneWorker::call).
// Such releases are queued here and done by the next call into the binding that holds the GIL.
std::mutex g_released_mu;
std::vector<PyObject*> g_released;

void release_owner(void* obj) noexcept {
  if (Py_IsInitialized() && PyGILState_Check()) {
    Py_DECREF(static_cast<PyObject*>(obj));
    return;
  }
  std::lock_guard<std::mutex> lock(g_released_mu);
  g_released.push_back(static_cast<PyObject*>(obj));
}

// With the GIL held: drops the references worker threads released since the last call.
void drain_released() {
  std::vector<PyObject*> objs;
  {
    std::lock_guard<std::mutex> lock(g_released_mu);
    objs.swap(g_released);
  }
  for (PyObject* o : objs) Py_DECREF(o);
}

std::shared_ptr<void> owner_of(nb::handle buffer) {
  if (buffer.is_none()) return {};
  return std::shared_ptr<void>(buffer.inc_ref().ptr(), release_owner);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "weightsync transfer engine (C++ core)";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ws::TimeoutError& e) {
      PyErr_SetString(error_class("TimeoutError").ptr(), e.what());
    } catch (const ws::TransportError& e) {
      PyErr_SetString(error_class("TransportError").ptr(), e.what());
    }
  });

  m.def("pick_provider", &ws::FabricLane::pick_provider);
  m.def("drain_log", [] {
    drain_released();
    return ws::drain_log();
  }, "Takes the engine's queued log records, oldest first, as (level, message) with Python's level\n"
     "numbers (weightsync.engine forwards them to the logger 'weightsync.engine'). Also releases the\n"
     "buffers the engine's threads let go of since the last call.");
  m.def("lane_types", [] {
    std::vector<std::string> out;
    for (const auto& t : ws::lane_types()) out.push_back(t.name);
    return out;
  }, "Names of the lane types an engine can open, in the order it opens them.");
  m.def("cuda_unavailable_reason", &ws::cuda_unavailable_reason);
  m.def("cuda_device_count", &ws::cuda_device_count);
  m.def("host_identity", &ws::host_identity);
  m.def(
      "imm_counts",
      [](Column<int64_t> nbytes, Column<int64_t> rows, int64_t nics, int64_t stripe_threshold, int64_t max_piece) {
        const size_t n = nbytes.shape(0);
        if (rows.shape(0) != n) throw std::invalid_argument("imm_counts: nbytes and rows differ in length");
        if (nics < 1) throw std::invalid_argument("imm_counts: nics must be at least 1");
        if (stripe_threshold < 0) throw std::invalid_argument("imm_counts: stripe_threshold must be >= 0");
        if (max_piece < 1) throw std::invalid_argument("imm_counts: max_piece must be positive");
        const ws::PieceRule rule{uint64_t(nics), uint64_t(stripe_threshold), uint64_t(max_piece)};
        auto* out = new int64_t[n];
        nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<int64_t*>(p); });
        for (size_t i = 0; i < n; ++i) {
          if (nbytes(i) < 0 || rows(i) < 1) {
            throw std::invalid_argument("imm_counts: write " + std::to_string(i) + " has " +
                                        std::to_string(nbytes(i)) + " bytes and " + std::to_string(rows(i)) +
                                        " rows (need bytes >= 0, rows >= 1)");
          }
          out[i] = int64_t(rule.imm_count(uint64_t(nbytes(i)), true, uint64_t(rows(i))));
        }
        return nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(out, {n}, owner);
      },
      "nbytes"_a, "rows"_a, "nics"_a, "stripe_threshold"_a, "max_piece"_a,
      "Immediates each write delivers from an engine with `nics` fabric NICs and this stripe_threshold and\n"
      "max_piece (an engine's values: TransferEngine.stripe_threshold, .max_piece). Every write carries an\n"
      "immediate; rows > 1 makes it a 2-D write of rows x nbytes, which delivers exactly one. The engine's\n"
      "own rule (cpp PieceRule), evaluated for each element.");
  // The delta push's compare and scatter for tensors in host memory (cpp/delta/host_delta.hpp), by address:
  // weightsync.runtime.delta_host checks the tensors and passes their data pointers.
  m.def(
      "delta_compare",
      [](int word, uintptr_t ref, int64_t ref_words, Column<uint64_t> addrs, Column<int64_t> words,
         uintptr_t out_idx, uintptr_t out_val, int64_t cap, int threads, uintptr_t scratch, int64_t scratch_bytes) {
        const size_t n = addrs.shape(0);
        if (words.shape(0) != n) throw std::invalid_argument("delta_compare: addrs and words differ in length");
        std::vector<ws::host_delta::Segment> keys(n);
        for (size_t i = 0; i < n; ++i) keys[i] = {reinterpret_cast<const void*>(uintptr_t(addrs(i))), words(i)};
        nb::gil_scoped_release release;
        return ws::host_delta::compare(word, reinterpret_cast<void*>(ref), ref_words, keys.data(), n,
                                       reinterpret_cast<int64_t*>(out_idx), reinterpret_cast<void*>(out_val),
                                       cap, threads, reinterpret_cast<void*>(scratch), scratch_bytes);
      },
      "word"_a, "ref"_a, "ref_words"_a, "addrs"_a, "words"_a, "out_idx"_a, "out_val"_a, "cap"_a, "threads"_a = 1,
      "scratch"_a = 0, "scratch_bytes"_a = 0,
      "The changed words of a word space (its keys at `addrs`, `words` each, end to end in the reference at\n"
      "`ref`), compared bitwise as `word`-byte integers: their sorted positions (int64) to `out_idx` and\n"
      "values to `out_val`, each put into the reference; the first `cap` only (the rest is neither written\n"
      "nor put into the reference: a second run finds exactly it; entries past the count may be\n"
      "overwritten). Returns how many changed in all. Up to `threads` threads, without the GIL; all but the\n"
      "first collect their changes in `scratch` (8 + 2 * word bytes a change) while it has room, then in\n"
      "memory of their own. ValueError names a bad argument.");
  m.def(
      "delta_scatter_idx16",
      [](int word, int64_t n, int64_t k, uintptr_t counts, uintptr_t low, uintptr_t vals,
         nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> runs, int threads) {
        if (runs.shape(0) > 0 && runs.shape(1) != 7) {
          throw std::invalid_argument("delta_scatter_idx16: runs must have 7 columns (address, words, shift, lo, "
                                      "hi, pos_lo, pos_hi), not " + std::to_string(runs.shape(1)));
        }
        std::vector<ws::host_delta::ScatterRun> rs(runs.shape(0));
        for (size_t i = 0; i < rs.size(); ++i) {
          rs[i] = {reinterpret_cast<void*>(uintptr_t(runs(i, 0))), runs(i, 1), runs(i, 2), runs(i, 3), runs(i, 4),
                   runs(i, 5), runs(i, 6)};
        }
        nb::gil_scoped_release release;
        ws::host_delta::scatter_idx16(word, n, k, reinterpret_cast<const int32_t*>(counts),
                                      reinterpret_cast<const uint16_t*>(low), reinterpret_cast<const void*>(vals),
                                      rs.data(), rs.size(), threads);
      },
      "word"_a, "n"_a, "k"_a, "counts"_a, "low"_a, "vals"_a, "runs"_a, "threads"_a = 1,
      "Scatters an ENC_IDX16 stream of `n` words of which `k` changed (its int32 block counts, 16-bit\n"
      "indices and values at these addresses) into its contiguous runs' keys: `runs` rows (key address,\n"
      "key words, shift, first and last+1 entry, first and last+1 stream position); entry j of a run goes\n"
      "to word `position + shift` of its key. Every entry is checked against its run and key (ValueError).\n"
      "Up to `threads` threads, without the GIL.");
  m.def(
      "delta_bitmap_to_idx16",
      [](uintptr_t bits, int64_t n, int64_t k, uintptr_t counts, uintptr_t low, int threads) {
        nb::gil_scoped_release release;
        ws::host_delta::bitmap_to_idx16(reinterpret_cast<const uint8_t*>(bits), n, k,
                                        reinterpret_cast<int32_t*>(counts), reinterpret_cast<uint16_t*>(low),
                                        threads);
      },
      "bits"_a, "n"_a, "k"_a, "counts"_a, "low"_a, "threads"_a = 1,
      "An ENC_BITMAP stream's bits (`n` words) as an ENC_IDX16 stream's int32 block counts and 16-bit\n"
      "indices, written at these addresses (ceil(n / 65536) counts, `k` indices) for delta_scatter_idx16.\n"
      "Bits past word `n` are ignored. ValueError where the bits below `n` are not exactly `k`. Up to\n"
      "`threads` threads, without the GIL.");
  m.def(
      "delta_bitmap_set",
      [](uintptr_t bits, int64_t n, uintptr_t positions, int64_t m, int64_t shift) {
        nb::gil_scoped_release release;
        ws::host_delta::bitmap_set(reinterpret_cast<uint8_t*>(bits), n, reinterpret_cast<const int64_t*>(positions),
                                   m, shift);
      },
      "bits"_a, "n"_a, "positions"_a, "m"_a, "shift"_a = 0,
      "Sets bit `position + shift` of a bitmap of `n` words for each of `m` int64 positions at `positions`.\n"
      "ValueError (nothing set) where one falls outside the `n` words. Without the GIL.");
  m.def("discover", [](const std::string& provider) {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const auto& nic : ws::FabricLane::discover(provider)) out.emplace_back(nic.provider, nic.domain, nic.fabric);
    return out;
  }, "provider"_a = "");

  // The shared-memory immediate ring of the cuda lane, bound on its own so that CPU-only tests can check
  // it between processes.
  nb::class_<ws::ImmRing>(m, "ImmRing")
      .def_static("create", &ws::ImmRing::create)
      .def_static("open", &ws::ImmRing::open, "pid"_a, "fd"_a)
      .def_prop_ro("fd", &ws::ImmRing::fd)
      .def("push", &ws::ImmRing::push, "imm"_a)
      .def("pop", [](ws::ImmRing& r) -> std::optional<uint32_t> {
        uint32_t imm = 0;
        if (r.pop(imm)) return imm;
        return std::nullopt;
      })
      .def("ticket", &ws::ImmRing::ticket)
      .def(
          "sleep",
          [](ws::ImmRing& r, int64_t timeout_us, std::optional<uint32_t> ticket) {
            r.sleep(timeout_us, ticket ? *ticket : r.ticket());
          },
          "timeout_us"_a, "ticket"_a = nb::none(), nb::call_guard<nb::gil_scoped_release>())
      .def("wake", &ws::ImmRing::wake)
      .def("set_live", &ws::ImmRing::set_live, "region_id"_a, "live"_a)
      .def("is_live", &ws::ImmRing::is_live, "region_id"_a)
      .def_ro_static("live_slots", &ws::ImmRing::kLiveSlots);

  nb::class_<ws::LocalRegion>(m, "Region")
      .def_ro("id", &ws::LocalRegion::id)
      .def_prop_ro("ptr", [](const ws::LocalRegion& r) { return reinterpret_cast<uintptr_t>(r.ptr); })
      .def_ro("len", &ws::LocalRegion::len)
      .def_prop_ro("kind", [](const ws::LocalRegion& r) { return static_cast<int>(r.kind); })
      .def_ro("device", &ws::LocalRegion::device)
      .def_prop_ro("valid", [](const ws::LocalRegion& r) { return r.valid.load(); })
      .def_prop_ro("keys", [](const ws::LocalRegion& r) {
        std::vector<uint64_t> out;
        for (size_t i = 0; i < r.fabric_nics; ++i) out.push_back(r.regs[i].key);
        return out;
      })
      .def_prop_ro("bases", [](const ws::LocalRegion& r) {
        std::vector<uint64_t> out;
        for (size_t i = 0; i < r.fabric_nics; ++i) out.push_back(r.regs[i].remote_base);
        return out;
      })
      .def_ro("on_fabric", &ws::LocalRegion::on_fabric)
      .def_ro("landing", &ws::LocalRegion::landing)
      .def_ro("landing_slot_bytes", &ws::LocalRegion::landing_slot_bytes)
      .def_ro("fabric_error", &ws::LocalRegion::fabric_error)
      .def_prop_ro("cuda_blob", [](const ws::LocalRegion& r) {
        for (size_t i = r.fabric_nics; i < r.regs.size(); ++i) {
          if (!r.regs[i].blob.empty()) return to_bytes(r.regs[i].blob);
        }
        return to_bytes(std::string());
      });

  nb::class_<ws::Peer>(m, "Peer")
      .def_ro("id", &ws::Peer::id)
      .def_ro("uid", &ws::Peer::uid)
      .def_ro("label", &ws::Peer::label)
      .def_ro("remote_nics", &ws::Peer::remote_nics)
      .def_ro("cuda", &ws::Peer::cuda)
      .def_prop_ro("failed_paths", [](ws::Peer& p) {
        std::vector<bool> out;
        for (size_t i = 0; i < p.nic_paths; ++i) out.push_back(p.path_failed[i].load());
        return out;
      })
      .def_prop_ro("last_error", [](ws::Peer& p) {
        std::lock_guard<std::mutex> lock(p.mu);
        return p.last_error;
      });

  nb::class_<ws::RemoteRegion>(m, "RemoteRegion")
      .def_ro("id", &ws::RemoteRegion::id)
      .def_ro("len", &ws::RemoteRegion::len)
      .def_ro("peer", &ws::RemoteRegion::peer)
      .def_prop_ro("by_copy", [](const ws::RemoteRegion& r) { return r.cuda_addr != 0; })
      .def_ro("landing", &ws::RemoteRegion::landing);

  nb::class_<ws::TransferState>(m, "Transfer")
      .def("wait", &ws::TransferState::wait, "timeout"_a, nb::call_guard<nb::gil_scoped_release>(),
           "True once every piece landed or one failed for good; False on timeout.")
      .def_prop_ro("done", &ws::TransferState::done)
      .def_prop_ro("failed", &ws::TransferState::failed)
      .def_prop_ro("error", &ws::TransferState::error)
      .def_prop_ro("pending", &ws::TransferState::pending)
      .def_prop_ro("imm_count", &ws::TransferState::imm_count)
      .def_prop_ro("bytes", &ws::TransferState::bytes)
      .def_prop_ro("what", &ws::TransferState::what);

  nb::class_<ws::LaneCaps>(m, "LaneCaps", "What a lane can do (cpp/core/lane.hpp documents each field).")
      .def_ro("is_nic", &ws::LaneCaps::is_nic)
      .def_ro("writes_host", &ws::LaneCaps::writes_host)
      .def_ro("writes_cuda", &ws::LaneCaps::writes_cuda)
      .def_ro("rma_keys", &ws::LaneCaps::rma_keys)
      .def_ro("maps_remote", &ws::LaneCaps::maps_remote)
      .def_ro("two_d", &ws::LaneCaps::two_d)
      .def_ro("own_imm", &ws::LaneCaps::own_imm)
      .def_ro("batching", &ws::LaneCaps::batching)
      .def_ro("tagged", &ws::LaneCaps::tagged)
      .def_ro("orders_sends", &ws::LaneCaps::orders_sends)
      .def_ro("delivery_complete", &ws::LaneCaps::delivery_complete)
      .def_ro("orders_writes", &ws::LaneCaps::orders_writes)
      .def_ro("local_copies", &ws::LaneCaps::local_copies)
      .def_ro("unlimited_window", &ws::LaneCaps::unlimited_window)
      .def_ro("control_queue", &ws::LaneCaps::control_queue);

  // Defaults live in the C++ struct alone: a default-constructed config is what Python starts from.
  nb::class_<ws::EngineConfig>(m, "EngineConfig",
                               "Everything an engine is opened with (cpp/core/engine.hpp documents each field).")
      .def(nb::init<>())
      .def_rw("transport", &ws::EngineConfig::transport)
      .def_rw("provider", &ws::EngineConfig::provider)
      .def_rw("nics", &ws::EngineConfig::nics)
      .def_rw("stripe_threshold", &ws::EngineConfig::stripe_threshold)
      .def_rw("max_piece", &ws::EngineConfig::max_piece)
      .def_rw("window_bytes", &ws::EngineConfig::window_bytes)
      .def_rw("window_ops", &ws::EngineConfig::window_ops)
      .def_rw("stall_timeout_s", &ws::EngineConfig::stall_timeout_s)
      .def_rw("cuda_device", &ws::EngineConfig::cuda_device)
      .def_rw("cuda_piece", &ws::EngineConfig::cuda_piece)
      .def_rw("cuda_streams", &ws::EngineConfig::cuda_streams)
      .def_rw("cuda_batch_bytes", &ws::EngineConfig::cuda_batch_bytes)
      .def_rw("cuda_spin_us", &ws::EngineConfig::cuda_spin_us)
      .def_rw("staging_slots", &ws::EngineConfig::staging_slots)
      .def_rw("landing_slots", &ws::EngineConfig::landing_slots)
      .def_rw("landing_slot_bytes", &ws::EngineConfig::landing_slot_bytes)
      .def_rw("cuda_peers", &ws::EngineConfig::cuda_peers)
      .def_rw("auth_key", &ws::EngineConfig::auth_key);

  nb::class_<ws::TestHooks>(m, "TestHooks",
                            "Test-only switches (cpp/core/engine.hpp); set through TransferEngine._for_tests.")
      .def(nb::init<>())
      .def_rw("stage_host_sources", &ws::TestHooks::stage_host_sources)
      .def_rw("land_host_regions", &ws::TestHooks::land_host_regions)
      .def_rw("lose_imm_acks", &ws::TestHooks::lose_imm_acks)
      .def_rw("cq_data_immediates", &ws::TestHooks::cq_data_immediates)
      .def_rw("no_path_abort", &ws::TestHooks::no_path_abort);

  nb::class_<ws::Engine>(m, "Engine")
      .def_static(
          "create",
          [](const ws::EngineConfig& config, std::optional<ws::TestHooks> hooks) {
            nb::gil_scoped_release release;
            return ws::Engine::create(config, hooks.value_or(ws::TestHooks{}));
          },
          "config"_a, "hooks"_a = nb::none())
      .def_prop_ro("config", [](const ws::Engine& e) {
        ws::EngineConfig c = e.config();
        c.auth_key.clear();  // the key stays in the engine (a config is printed, logged, pickled)
        return c;
      },
                   "The configuration in force (a copy): the lanes' choices and clamps applied.")
      .def_prop_ro("lanes", [](ws::Engine& e) { return e.lane_caps(); },
                   "Per lane (NIC lanes first): its type name and what it can do (LaneCaps).")
      .def_prop_ro("uid", &ws::Engine::uid)
      .def_prop_ro("provider", &ws::Engine::provider)
      .def_prop_ro("transport", &ws::Engine::transport_kind)
      .def_prop_ro("nic_names", &ws::Engine::nic_names)
      .def_prop_ro("nic_addresses", [](const ws::Engine& e) {
        std::vector<nb::bytes> out;
        for (const auto& a : e.nic_addresses()) out.push_back(to_bytes(a));
        return out;
      })
      .def_prop_ro("cuda_address", [](const ws::Engine& e) { return to_bytes(e.cuda_address()); })
      .def_prop_ro("cuda_name", &ws::Engine::cuda_name)
      .def_prop_ro("doorbell_bases", &ws::Engine::doorbell_bases)
      .def_prop_ro("doorbell_keys", &ws::Engine::doorbell_keys)
      .def_prop_ro("stripe_threshold", [](const ws::Engine& e) { return e.config().stripe_threshold; })
      .def_prop_ro("max_piece", [](const ws::Engine& e) { return e.config().max_piece; })
      .def_prop_ro("two_d_mode", &ws::Engine::two_d_mode)
      .def_prop_ro("closed", &ws::Engine::closed)
      .def("register", [](ws::Engine& e, uintptr_t ptr, uint64_t len, int kind, int device, nb::object owner) {
        drain_released();
        std::shared_ptr<void> keep = owner_of(owner);
        nb::gil_scoped_release release;
        // Never internal: only the engine's own buffers bypass test-mode staging.
        return e.register_memory(reinterpret_cast<void*>(ptr), len, static_cast<ws::MemKind>(kind), device, false,
                                 std::move(keep));
      }, "ptr"_a, "nbytes"_a, "kind"_a, "device"_a, "owner"_a.none() = nb::none(),
         "Registers memory; `owner` (the object the memory belongs to) is referenced until the region is\n"
         "deregistered or dropped and no write reading from it is left in the engine or a NIC.")
      .def("deregister", [](ws::Engine& e, std::shared_ptr<ws::LocalRegion> region) {
        {
          nb::gil_scoped_release release;
          e.deregister(region);
        }
        drain_released();
      }, "region"_a)
      .def("connect", [](ws::Engine& e, const std::string& uid, const std::string& provider,
                         const std::vector<nb::bytes>& addresses, nb::bytes cuda_address,
                         const std::vector<uint64_t>& doorbell_base, const std::vector<uint64_t>& doorbell_key) {
        std::vector<std::string> addrs;
        for (const auto& a : addresses) addrs.emplace_back(a.c_str(), a.size());
        std::string cuda(cuda_address.c_str(), cuda_address.size());
        nb::gil_scoped_release release;
        return e.connect(uid, provider, addrs, cuda, doorbell_base, doorbell_key);
      }, "uid"_a, "provider"_a, "addresses"_a, "cuda_address"_a, "doorbell_base"_a, "doorbell_key"_a)
      .def("import_region", [](ws::Engine& e, std::shared_ptr<ws::Peer> peer, uint64_t id, uint64_t len,
                               const std::vector<uint64_t>& base, const std::vector<uint64_t>& key,
                               nb::bytes cuda_blob, int landing, uint64_t slot_bytes) {
        std::string blob(cuda_blob.c_str(), cuda_blob.size());
        nb::gil_scoped_release release;
        return e.import_region(peer, id, len, base, key, blob, landing, slot_bytes);
      }, "peer"_a, "region_id"_a, "nbytes"_a, "base"_a, "key"_a, "cuda_blob"_a, "landing"_a = -1, "slot_bytes"_a = 0)
      .def("imm_count", &ws::Engine::imm_count, "nbytes"_a, "has_imm"_a = true, "rows"_a = 1)
      .def("write", [](ws::Engine& e, std::shared_ptr<ws::LocalRegion> src, uint64_t src_off,
                       std::shared_ptr<ws::RemoteRegion> dst, uint64_t dst_off, uint64_t len,
                       std::optional<uint32_t> imm, uint64_t rows, uint64_t src_pitch, uint64_t dst_pitch) {
        drain_released();
        ws::WriteOp op{0, src_off, 0, dst_off, len, imm.value_or(0), rows, src_pitch, dst_pitch};
        return e.write({std::move(src)}, {std::move(dst)}, &op, 1, imm.has_value());
      }, "src"_a, "src_off"_a, "dst"_a, "dst_off"_a, "nbytes"_a, "imm"_a.none(), "rows"_a = 1, "src_pitch"_a = 0,
         "dst_pitch"_a = 0)
      .def("write_batch", [](ws::Engine& e, const std::vector<std::shared_ptr<ws::LocalRegion>>& srcs,
                             const std::vector<std::shared_ptr<ws::RemoteRegion>>& dsts, Column<uint32_t> src_idx,
                             Column<uint64_t> src_off, Column<uint32_t> dst_idx, Column<uint64_t> dst_off,
                             Column<uint64_t> len, std::optional<Column<uint32_t>> imm,
                             std::optional<Column<uint64_t>> rows, std::optional<Column<uint64_t>> src_pitch,
                             std::optional<Column<uint64_t>> dst_pitch) {
        drain_released();
        const size_t n = src_idx.shape(0);
        auto bad = [n](const auto& col) { return col && col->shape(0) != n; };
        if (src_off.shape(0) != n || dst_idx.shape(0) != n || dst_off.shape(0) != n || len.shape(0) != n ||
            bad(imm) || bad(rows) || bad(src_pitch) || bad(dst_pitch)) {
          throw ws::UsageError("write_batch: all columns must have the same length");
        }
        std::vector<ws::WriteOp> ops(n);
        for (size_t i = 0; i < n; ++i) {
          ops[i] = ws::WriteOp{src_idx(i), src_off(i), dst_idx(i), dst_off(i), len(i), imm ? (*imm)(i) : 0u,
                               rows ? (*rows)(i) : 1u, src_pitch ? (*src_pitch)(i) : 0u,
                               dst_pitch ? (*dst_pitch)(i) : 0u};
        }
        return e.write(srcs, dsts, ops.data(), n, imm.has_value());
      }, "srcs"_a, "dsts"_a, "src_idx"_a, "src_off"_a, "dst_idx"_a, "dst_off"_a, "nbytes"_a, "imm"_a.none(),
         "rows"_a.none() = nb::none(), "src_pitch"_a.none() = nb::none(), "dst_pitch"_a.none() = nb::none())
      .def("forward", [](ws::Engine& e, uint32_t on_imm, uint64_t count, std::shared_ptr<ws::LocalRegion> src,
                         uint64_t src_off, std::shared_ptr<ws::RemoteRegion> dst, uint64_t dst_off, uint64_t len,
                         std::optional<uint32_t> imm, uint64_t rows, uint64_t src_pitch, uint64_t dst_pitch) {
        ws::WriteOp op{0, src_off, 0, dst_off, len, imm.value_or(0), rows, src_pitch, dst_pitch};
        return e.forward(on_imm, count, {std::move(src)}, {std::move(dst)}, &op, 1, imm.has_value());
      }, "on_imm"_a, "count"_a, "src"_a, "src_off"_a, "dst"_a, "dst_off"_a, "nbytes"_a, "imm"_a.none(), "rows"_a = 1,
         "src_pitch"_a = 0, "dst_pitch"_a = 0)
      .def("cancel_forwards", &ws::Engine::cancel_forwards, "trigger_id"_a, "by_imm"_a, "imm"_a)
      .def_prop_ro("pending_forwards", &ws::Engine::pending_forwards)
      .def("forward_pending", &ws::Engine::forward_pending, "trigger_id"_a)
      .def("counter_wait", [](ws::Engine& e, uint32_t imm, uint64_t n, double timeout) {
        return e.counters().wait(imm, n, timeout);
      }, "imm"_a, "n"_a, "timeout"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("counter_value", [](ws::Engine& e, uint32_t imm) { return e.counters().value(imm); }, "imm"_a)
      .def("counter_total", [](ws::Engine& e, uint32_t imm) { return e.counters().total(imm); }, "imm"_a)
      .def("counter_reset", [](ws::Engine& e, uint32_t imm) { return e.counters().reset(imm); }, "imm"_a)
      .def("set_auth_key", &ws::Engine::set_auth_key, "key_hex"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("stats", [](ws::Engine& e) {
        nb::list out;
        for (const auto& s : e.stats()) {
          nb::dict d;
          d["nic"] = s.name;
          d["provider"] = s.provider;
          d["bytes"] = s.bytes_completed;
          d["writes"] = s.writes_completed;
          d["imm_received"] = s.imm_received;
          d["imm_duplicates"] = s.imm_duplicates;
          d["errors"] = s.errors;
          d["rerouted"] = s.rerouted;
          d["failed_paths"] = s.failed_paths;
          d["restored_paths"] = s.restored_paths;
          d["in_flight"] = s.in_flight;
          d["landed"] = s.landed;
          d["landed_bytes"] = s.landed_bytes;
          d["landing_dropped"] = s.landing_dropped;
          d["auth_refused"] = s.auth_refused;
          out.append(d);
        }
        return out;
      })
      .def("close", [](ws::Engine& e) {
        {
          nb::gil_scoped_release release;
          e.close();
        }
        drain_released();  // the workers are joined: every piece's reference was let go by now
      });
}
