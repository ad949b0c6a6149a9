// The flags of `kvferry prefill` and `kvferry decode`: their definitions, range checks and the
// model they name.
#include <CLI/CLI.hpp>

#include "common/checks.h"
#include "kvferry/faults.h"
#include "tools/auth_flags.h"
#include "tools/commands.h"
#include "tools/flag_checks.h"
#include "tools/instance.h"

namespace kvferry::tools {

Status CheckInstanceFlags(const InstanceFlags& f, bool prefill) {
  RETURN_IF_ERROR(CheckFlagRange("--page-size", f.page_size, 1, kMaxPageSize));
  RETURN_IF_ERROR(CheckFlagRange("--control-port", f.control_port, 0, 65535));
  RETURN_IF_ERROR(CheckFlagRange("--aux-rows", f.aux_rows, 1, kMaxAuxRows));
  RETURN_IF_ERROR(CheckFlagRange("--state-slots", f.state_slots, 1, kMaxStateSlots));
  RETURN_IF_ERROR(CheckFlagRange("--timeout-ms", f.timeout_ms, kMinTimeoutMs, kMaxTimeoutMs));
  RETURN_IF_ERROR(CheckFlagRange("--gpu", f.gpu, 0, kMaxGpu));
  RETURN_IF_ERROR(CheckFlagRange("--tp-size", f.tp_size, 1, kMaxParallelRanks));
  RETURN_IF_ERROR(CheckFlagRange("--tp-rank", f.tp_rank, 0, f.tp_size - 1));
  RETURN_IF_ERROR(CheckFlagRange("--abort-every", f.abort_every, 0));
  RETURN_IF_ERROR(CheckFlagRange("--exit-with-parent", f.exit_with_parent, 0));
  if (auto plan = ParseFaultPlan(f.faults); !plan.ok()) {
    return plan.status().WithContext("--faults");
  }
  if (prefill) {
    RETURN_IF_ERROR(CheckFlagRange("--bootstrap-port", f.bootstrap_port, 0, 65535));
    RETURN_IF_ERROR(CheckFlagRange("--cp-size", f.cp_size, 1, kMaxParallelRanks));
    RETURN_IF_ERROR(CheckFlagRange("--cp-rank", f.cp_rank, 0, f.cp_size - 1));
    RETURN_IF_ERROR(CheckFlagRange("--chunk-tokens", f.chunk_tokens, 1, kMaxChunkTokens));
    RETURN_IF_ERROR(
        CheckFlagRange("--compute-us-per-layer", f.compute_us_per_layer, 0, kMaxComputeUsPerLayer));
  }
  return OkStatus();
}

std::vector<std::string> InstanceChildArgs(const InstanceFlags& f, bool prefill, int parent_pid) {
  std::vector<std::string> a = {"--page-size",   std::to_string(f.page_size),
                                "--pool-size",   f.pool_size,
                                "--transport",   f.transport,
                                "--host",        f.host,
                                "--timeout-ms",  std::to_string(f.timeout_ms),
                                "--aux-rows",    std::to_string(f.aux_rows),
                                "--state-slots", std::to_string(f.state_slots)};
  if (!f.model_config.empty()) {
    a.insert(a.end(), {"--model-config", f.model_config});
  } else {
    a.insert(a.end(), {"--model", f.model});
  }
  if (prefill) {
    a.insert(a.end(), {"--chunk-tokens", std::to_string(f.chunk_tokens), "--compute-us-per-layer",
                       std::to_string(f.compute_us_per_layer)});
    if (f.layerwise) a.push_back("--layerwise");
  }
  a.insert(a.end(), {"--device", f.device, "--gpu", std::to_string(f.gpu), "--tp-rank",
                     std::to_string(f.tp_rank), "--tp-size", std::to_string(f.tp_size)});
  if (prefill && !f.join_bootstrap.empty())
    a.insert(a.end(), {"--join-bootstrap", f.join_bootstrap});
  if (!prefill) a.insert(a.end(), {"--kv-path", f.kv_path, "--staging-size", f.staging_size});
  if (f.pull) a.push_back("--pull");
  if (prefill && f.cp_size > 1) {
    a.insert(a.end(),
             {"--cp-rank", std::to_string(f.cp_rank), "--cp-size", std::to_string(f.cp_size)});
    if (f.cp_rank0_only) a.push_back("--cp-rank0-only");
  }
  if (f.abort_every > 0) {
    a.insert(a.end(), {"--abort-every", std::to_string(f.abort_every)});
  }
  if (!f.faults.empty()) a.insert(a.end(), {"--faults", f.faults});
  a.insert(a.end(), {"--exit-with-parent", std::to_string(parent_pid)});
  return a;
}

StatusOr<ModelGeometry> ResolveModel(const std::string& model, const std::string& model_config) {
  if (!model_config.empty()) {
    auto g = LoadHfConfig(model_config);
    if (!g.ok()) return g.status().WithContext("--model-config");
    return g;
  }
  auto g = FindModelPreset(model);
  if (!g.ok()) return g.status().WithContext("--model");
  return g;
}

namespace {
void AddInstanceFlags(CLI::App* cmd, InstanceFlags* f, bool prefill) {
  cmd->add_option("--model", f->model, "Model preset (KV geometry)")->capture_default_str();
  cmd->add_option("--model-config", f->model_config,
                  "Hugging Face config.json (overrides --model)");
  cmd->add_option("--page-size", f->page_size, "Tokens per KV page")->capture_default_str();
  cmd->add_option("--pool-size", f->pool_size, "KV pool bytes (KiB/MiB/GiB suffixes)")
      ->capture_default_str();
  cmd->add_option("--transport", f->transport, "Transport: auto, tcp, ucx or nvlink")
      ->capture_default_str();
  cmd->add_option("--host", f->host, "Address to listen on")->capture_default_str();
  cmd->add_option("--control-port", f->control_port, "HTTP control port (0 = any)");
  cmd->add_option("--aux-rows", f->aux_rows, "Aux (metadata) rows")->capture_default_str();
  cmd->add_option("--state-slots", f->state_slots,
                  "Hybrid models: linear-attention state slots (requests in flight)")
      ->capture_default_str();
  cmd->add_option("--timeout-ms", f->timeout_ms, "Bootstrap/waiting/transfer timeout")
      ->capture_default_str();
  cmd->add_option("--device", f->device, "Where pools live: cpu or cuda")->capture_default_str();
  cmd->add_option("--gpu", f->gpu, "CUDA device for --device cuda")->capture_default_str();
  AddAuthFlags(cmd, &f->auth);
  cmd->add_option("--exit-with-parent", f->exit_with_parent,
                  "End when process PID (the replay that started it) ends")
      ->group("");
  cmd->add_option("--tp-rank", f->tp_rank, "Attention TP rank of this instance")
      ->capture_default_str();
  cmd->add_option("--tp-size", f->tp_size, "Attention TP size (this rank holds its share of heads)")
      ->capture_default_str();
  if (!prefill) {
    cmd->add_option("--kv-path", f->kv_path, "Unequal TP: auto, direct, staging or fused")
        ->capture_default_str();
    cmd->add_option("--staging-size", f->staging_size, "Staging ring bytes for --kv-path staging")
        ->capture_default_str();
  }
  cmd->add_flag("--pull", f->pull,
                prefill ? "Let decode ranks that pull READ this instance's pools"
                        : "READ each batch from prefill's pools (prefill plans it) instead of "
                          "prefill WRITing it");
  cmd->add_option("--faults", f->faults,
                  "Fault-injection plan of this instance's engine (kvferry/faults.h), e.g. "
                  "drop=0.01,fail=0.02,delay_us=500; for tests and drills");
  cmd->add_option("--abort-every", f->abort_every,
                  "Failure drill (GPU, layerwise): prefill aborts rooms whose id is a multiple of "
                  "N halfway through their compute; decode counts late writes into them")
      ->capture_default_str();
  if (prefill) {
    cmd->add_option("--cp-rank", f->cp_rank, "Context-parallel rank")->capture_default_str();
    cmd->add_option("--cp-size", f->cp_size, "Context-parallel size (each rank sends its pages)")
        ->capture_default_str();
    cmd->add_flag("--cp-rank0-only", f->cp_rank0_only,
                  "Old behaviour: CP rank 0 sends every page, the others only report");
    cmd->add_option("--join-bootstrap", f->join_bootstrap,
                    "Bootstrap server of prefill rank 0 to register with (ranks > 0)");
    cmd->add_option("--bootstrap-port", f->bootstrap_port, "Bootstrap server port (0 = any)");
    cmd->add_option("--chunk-tokens", f->chunk_tokens, "Tokens per prefill chunk")
        ->capture_default_str();
    cmd->add_option("--compute-us-per-layer", f->compute_us_per_layer,
                    "Simulated prefill compute per model layer (microseconds)")
        ->capture_default_str();
    cmd->add_flag("--layerwise", f->layerwise,
                  "Mark each layer ready as it finishes (layerwise transfer)");
  }
}
}  // namespace

void AddInstanceCommands(CLI::App& app, RunFn* run) {
  auto flags = std::make_shared<InstanceFlags>();
  auto* prefill =
      app.add_subcommand("prefill", "Run a prefill instance (bootstrap server + sender)");
  AddInstanceFlags(prefill, flags.get(), true);
  prefill->callback([run, flags] { *run = [flags] { return RunPrefillInstance(*flags); }; });
  auto* decode = app.add_subcommand("decode", "Run a decode instance (receiver + verifier)");
  AddInstanceFlags(decode, flags.get(), false);
  decode->callback([run, flags] { *run = [flags] { return RunDecodeInstance(*flags); }; });
}

}  // namespace kvferry::tools
