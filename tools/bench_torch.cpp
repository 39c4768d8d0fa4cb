#include "tools/bench_torch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

namespace sparse_mla::tools::bench {

namespace {

bool exists(const std::string& p) { return access(p.c_str(), R_OK) == 0; }

// bench/torch_baseline.py: SPARSE_MLA_TORCH_SCRIPT, the working directory, or the source tree
// above the executable (build-*/tools/sparse-mla).
std::string find_script() {
  if (const char* env = std::getenv("SPARSE_MLA_TORCH_SCRIPT"); env && *env) return env;
  if (exists("bench/torch_baseline.py")) return "bench/torch_baseline.py";
  char exe[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    std::string dir(exe, static_cast<size_t>(n));
    for (int up = 0; up < 4; ++up) {
      dir = dir.substr(0, dir.find_last_of('/'));
      if (exists(dir + "/bench/torch_baseline.py")) return dir + "/bench/torch_baseline.py";
    }
  }
  return "";
}

bool write_bytes(const std::string& path, const void* data, size_t bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(data, 1, bytes, f) == bytes;
  return std::fclose(f) == 0 && ok;
}

bool read_bytes(const std::string& path, void* data, size_t bytes) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  const bool ok = std::fread(data, 1, bytes, f) == bytes;
  std::fclose(f);
  return ok;
}

size_t tensor_bytes(const ref::HostTensor& t) {
  return static_cast<size_t>(t.numel()) * dtype_size(t.dtype());  // contiguous inputs only
}

size_t cache_bytes(const ref::HostCache& c) {
  const KVCache d = c.desc();
  return static_cast<size_t>(d.num_pages * d.page_stride);
}

}  // namespace

TorchBaseline::~TorchBaseline() { stop(); }

void TorchBaseline::stop() {
  if (to_child_) {
    std::fputs("QUIT\n", to_child_);
    std::fclose(to_child_);
    to_child_ = nullptr;
  }
  if (from_child_) {
    std::fclose(from_child_);
    from_child_ = nullptr;
  }
  if (pid_ > 0) {
    int st = 0;
    waitpid(pid_, &st, 0);
    pid_ = -1;
  }
  if (!dir_.empty()) {
    rmdir(dir_.c_str());
    dir_.clear();
  }
}

Status TorchBaseline::start(const std::string& python, const std::string& device_kind,
                            int device_index) {
  const std::string script = find_script();
  if (script.empty()) {
    return Status::InvalidArgument(
        "--torch: bench/torch_baseline.py not found (run from the "
        "repository root or set SPARSE_MLA_TORCH_SCRIPT)");
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/sparse-mla-torch-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) return Status::Internal("--torch: cannot create a temporary directory");
  dir_ = buf.data();

  int in_pipe[2], out_pipe[2];
  if (pipe(in_pipe) != 0 || pipe(out_pipe) != 0) return Status::Internal("--torch: pipe failed");
  signal(SIGPIPE, SIG_IGN);  // a dead child must give an error, not kill the bench
  pid_ = fork();
  if (pid_ < 0) return Status::Internal("--torch: fork failed");
  if (pid_ == 0) {
    dup2(in_pipe[0], 0);
    dup2(out_pipe[1], 1);
    close(in_pipe[0]);
    close(in_pipe[1]);
    close(out_pipe[0]);
    close(out_pipe[1]);
    const std::string dev = device_kind == "cuda" ? "cuda:" + std::to_string(device_index) : "cpu";
    execlp(python.c_str(), python.c_str(), script.c_str(), "--serve", "--device", dev.c_str(),
           static_cast<char*>(nullptr));
    std::fprintf(stderr, "cannot run %s: %s\n", python.c_str(), std::strerror(errno));
    _exit(127);
  }
  close(in_pipe[0]);
  close(out_pipe[1]);
  to_child_ = fdopen(in_pipe[1], "w");
  from_child_ = fdopen(out_pipe[0], "r");
  std::string reply;
  Status s = request("", &reply);
  if (!s.ok()) {
    stop();
    return s;
  }
  description_ = reply;
  on_gpu_ = device_kind == "cuda";
  return Status::Ok();
}

// Sends one line (none when empty) and reads one reply line: "OK\t<payload>" or "ERROR\t<why>".
Status TorchBaseline::request(const std::string& line, std::string* reply) {
  if (!to_child_ || !from_child_) return Status::Internal("PyTorch baseline is not running");
  if (!line.empty()) {
    std::fputs((line + "\n").c_str(), to_child_);
    std::fflush(to_child_);
  }
  std::string got;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, from_child_)) {
    got += buf;
    if (!got.empty() && got.back() == '\n') break;
  }
  if (got.empty()) {
    stop();
    return Status::Internal("PyTorch baseline exited (see its messages above)");
  }
  got.pop_back();
  if (got.rfind("OK\t", 0) == 0) {
    *reply = got.substr(3);
    return Status::Ok();
  }
  return Status::Internal("PyTorch baseline: " +
                          (got.rfind("ERROR\t", 0) == 0 ? got.substr(6) : got));
}

Result TorchBaseline::run(const Case& c, const Inputs& in, const Expected& expected, int runs,
                          int warmup) {
  Result res;
  res.backend = "torch";
  if (c.op != OpKind::kSparseDecode && c.op != OpKind::kDenseDecode) {
    res.status = "skipped";
    res.message = "no PyTorch baseline for KV kernels";
    return res;
  }
  std::vector<std::string> files;
  std::ostringstream m;
  bool ok = true;
  auto put_tensor = [&](const char* key, const ref::HostTensor& t) {
    if (!t.defined()) return;
    const std::string path = dir_ + "/" + key + ".bin";
    ok = ok && write_bytes(path, t.data(), tensor_bytes(t));
    files.push_back(path);
    m << key << ' ' << path << '\n';
  };
  auto put_cache = [&](const char* key, const ref::HostCache& k) {
    if (!k.defined()) return;
    const std::string path = dir_ + "/" + key + ".bin";
    const KVCache d = k.desc();
    ok = ok && write_bytes(path, d.data, cache_bytes(k));
    files.push_back(path);
    m << key << ' ' << path << '\n'
      << key << "_pages " << d.num_pages << '\n'
      << key << "_page_size " << d.page_size << '\n'
      << key << "_page_stride " << d.page_stride << '\n'
      << key << "_heads " << d.num_heads << '\n';
  };
  m << "op " << op_name(c.op) << "\nformat " << kv_format_name(c.format) << "\nb " << c.b
    << "\ns_q " << c.s_q << "\nh_q " << c.h_q << "\nd_qk " << kv_format_d_qk(c.format)
    << "\ncausal " << (c.causal ? 1 : 0) << "\nruns " << runs << "\nwarmup " << warmup << '\n';
  char scale[64];
  std::snprintf(scale, sizeof scale, "%.9g", static_cast<double>(in.softmax_scale));
  m << "scale " << scale << '\n';
  put_tensor("q", in.q);
  put_cache("kv", in.kv);
  if (c.op == OpKind::kSparseDecode) {
    m << "topk " << c.topk << '\n';
    put_tensor("indices", in.indices);
    if (in.extra_kv.defined()) {
      m << "extra_topk " << c.extra_topk << '\n';
      put_cache("extra_kv", in.extra_kv);
      put_tensor("extra_indices", in.extra_indices);
      put_tensor("extra_topk_length", in.extra_topk_length);
    }
    put_tensor("attn_sink", in.attn_sink);
  } else {
    m << "max_pages " << in.block_table.shape()[1] << '\n';
    put_tensor("block_table", in.block_table);
    put_tensor("cache_seqlens", in.cache_seqlens);
  }
  const std::string out_path = dir_ + "/out.bin", lse_path = dir_ + "/lse.bin";
  m << "out " << out_path << "\nlse " << lse_path << '\n';
  const std::string manifest = dir_ + "/case.txt";
  const std::string text = m.str();
  ok = ok && write_bytes(manifest, text.data(), text.size());
  files.push_back(manifest);
  files.push_back(out_path);
  files.push_back(lse_path);

  std::string reply;
  Status s = ok ? request("RUN " + manifest, &reply)
                : Status::Internal("cannot write the inputs to " + dir_ + " (disk full?)");
  HostOutputs outs = make_outputs(c, in);
  if (s.ok()) {
    const bool got = read_bytes(out_path, outs.out.data(), tensor_bytes(outs.out)) &&
                     read_bytes(lse_path, outs.lse.data(), tensor_bytes(outs.lse));
    if (!got) s = Status::Internal("PyTorch baseline wrote no complete outputs");
  }
  for (const auto& f : files) std::remove(f.c_str());
  if (!s.ok()) {
    res.status = "error";
    res.message = s.message();
    return res;
  }
  std::vector<double> us;
  std::istringstream times(reply);
  for (std::string t; std::getline(times, t, ',');) us.push_back(std::strtod(t.c_str(), nullptr));
  res.verdict = verify(c, in, expected, outs);
  if (!res.verdict.ok) {
    res.status = "failed";
    res.message = res.verdict.message;
    return res;
  }
  res.time = summarize(us);
  res.status = "ok";
  return res;
}

}  // namespace sparse_mla::tools::bench
