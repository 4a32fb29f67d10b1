// cuda-probe: what a CUDA program in this container sees of the GPU driver.
//
// It loads the driver the way CUDA applications and the CUDA runtime do: dlopen("libcuda.so.1") and
// dlopen("libnvidia-ml.so.1") by soname, no path and no LD_LIBRARY_PATH, so the dynamic loader's own
// search (its default directories, /usr/lib/x86_64-linux-gnu among them) decides which file is used. It
// then prints one line per fact, `<fact> key=value ...` with any free text (a device name, an error
// string) last as `name=...`, for e2e/k8s/e2etest/realnode_test.go to parse:
//
//   loader ld_library_path=<LD_LIBRARY_PATH or "unset">
//   lib soname=libcuda.so.1 path=<the loader's link-map name> real=<realpath> mount=yes|no
//   ldcache file=<libcuda.so.1|libcuda.so|libnvidia-ml.so.1> path=<a path /etc/ld.so.cache maps it to>
//   ldcache error=1 name=<strerror>          (no readable /etc/ld.so.cache)
//   devlink path=<libcuda.so.1's dir>/libcuda.so target=<readlink or "none"> dlopen=ok|<dlerror>
//   cuda.init rc=<CUresult> name=<cuGetErrorName>
//   cuda.driver rc=<r> version=<cuDriverGetVersion>
//   cuda.count rc=<r> count=<cuDeviceGetCount>
//   cuda.device index=<i> uuid=<GPU-…|MIG-…> mem=<cuDeviceTotalMem bytes> sms=<multiprocessors> name=<cuDeviceGetName>
//   cuda.ctx index=<i> rc=<cuCtxCreate> mps=yes|no|unknown [server=<pid>] memtotal=<cuMemGetInfo total>
//            sms=<cuCtxGetExecAffinity SM count> name=<error name>
//   cuda.sm_share index=<i> rc=0 share=<0..1> busy=<n>     (an MPS context on the simulated driver; see below)
//   cuda.module index=<i> rc=<cuModuleLoadData of a small PTX module in that context> name=<error name>
//   nvml.init rc=<nvmlReturn_t> name=<nvmlErrorString>
//   nvml.driver rc=<r> version=<nvmlSystemGetDriverVersion>
//   nvml.count rc=<r> count=<nvmlDeviceGetCount_v2>
//   nvml.gpu index=<i> uuid=<GPU-…> mig=<current MIG mode> migmax=<n> name=<nvmlDeviceGetName>
//   nvml.mig gpu=<i> index=<slot> uuid=<MIG-…>
//   exit code=<n>
//
// `ldcache` lines are every path in the loader's cache whose file name is one of the three (the cache's
// string table holds each entry's key and path as NUL-terminated strings, in both cache formats): the
// CDI hook's `update-ldcache` put them there. `devlink` is the development link `libcuda.so` beside the
// loaded `libcuda.so.1` (the hook's `create-symlinks`) and whether dlopen("libcuda.so") works, as Triton and
// `torch.compile` need; it runs last, so it cannot change which file the `lib` lines name.
//
// `mount=yes` says the resolved path is a mount point of this container (/proc/self/mountinfo): the file
// came from the driver's bind mount (the CDI spec's), not from the image.
//
// UUIDs: cuDeviceGetUuid_v2 gives 16 bytes (a MIG device's own UUID; cuDeviceGetUuid, the older entry
// point, the parent GPU's), printed as nvidia-smi and CUDA_VISIBLE_DEVICES spell them,
// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`. CUDA does not say whether a device is a MIG device; like
// tools that map CUDA devices to NVML's (DCGM), the prefix is `MIG-` when NVML lists a MIG device with
// those bytes, else `GPU-`.
//
// `cuda.module`: PTX is compiled by the driver's JIT, `libnvidia-ptxjitcompiler.so.1`, which libcuda
// `dlopen`s by soname when the first PTX module loads (as PyTorch, Triton and CuPy kernels do): a CDI spec
// that leaves it out gives contexts that work and PTX that fails with CUDA_ERROR_JIT_COMPILER_NOT_FOUND
// (221). The module is one empty kernel for sm_70, which every GPU since Volta JIT-compiles.
//
// MPS: a CUDA context does not say whether it runs through an MPS server (what it shows is the server's
// limits: cuMemGetInfo's total is the pinned memory limit, cuCtxGetExecAffinity's SM count the active
// thread percentage of the SMs). The simulated driver built by this repository
// (kubelet-plugin/sim-driver/cuda) exports a private `tesseraSimCtxGetMpsServerPid(ctx, &pid)` that says
// (CUDA_ERROR_NOT_SUPPORTED for a direct context); with NVIDIA's libcuda the symbol is absent and the
// probe prints `mps=unknown`. Likewise `tesseraSimCtxGetSmShare(ctx, &share, &busy)`: the part of the GPU's
// SMs (0-1) the context's kernels get while it is busy, beside the other busy MPS clients of its GPU, and
// how many busy clients that is (itself included): a burstable share alone sees its ceiling, and less
// when its neighbours are busy too (kubelet-plugin/sim-driver/model/src/contention.rs).
//
// No NVIDIA header is needed: the few prototypes are declared below as cuda.h and nvml.h define them.
// Exit status: 0 when cuInit succeeded, 1 when it failed, 2 when libcuda.so.1 could not be loaded.

#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

// --- cuda.h ---
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef struct {
  char bytes[16];
} CUuuid;
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_EXEC_AFFINITY_TYPE_SM_COUNT 0
typedef struct {
  int type;
  union {
    struct {
      unsigned val;
    } smCount;
  } param;
} CUexecAffinityParam;

// The smallest PTX module: one empty kernel.
static const char probe_ptx[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry tessera_probe() { ret; }\n";

// --- nvml.h ---
typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96
#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96
#define NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE 80

#define MAX_UUIDS 256

static char mig_uuids[MAX_UUIDS][NVML_DEVICE_UUID_V2_BUFFER_SIZE];
static int n_mig_uuids;

// The symbol `name` of `lib`, or NULL (printed once as a `missing` line).
static void *sym(void *lib, const char *soname, const char *name) {
  void *p = lib ? dlsym(lib, name) : NULL;
  if (lib && !p) printf("missing lib=%s symbol=%s\n", soname, name);
  return p;
}

// Whether `path` is a mount point in /proc/self/mountinfo (field 5; octal escapes as the kernel writes them).
static int is_mount_point(const char *path) {
  FILE *f = fopen("/proc/self/mountinfo", "r");
  if (!f) return 0;
  char line[4096];
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) {
    char point[PATH_MAX];
    if (sscanf(line, "%*s %*s %*s %*s %4095s", point) != 1) continue;
    char decoded[PATH_MAX];
    size_t o = 0;
    for (const char *c = point; *c && o + 1 < sizeof decoded; c++) {
      if (c[0] == '\\' && c[1] >= '0' && c[1] <= '7' && c[2] && c[3]) {
        decoded[o++] = (char)strtol((char[]){c[1], c[2], c[3], 0}, NULL, 8);
        c += 3;
      } else {
        decoded[o++] = *c;
      }
    }
    decoded[o] = 0;
    found = strcmp(decoded, path) == 0;
  }
  fclose(f);
  return found;
}

// dlopen by soname, then say which file the loader chose.
static void *load(const char *soname) {
  void *lib = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    printf("lib soname=%s error=1 name=%s\n", soname, dlerror());
    return NULL;
  }
  struct link_map *map = NULL;
  const char *path = "?";
  if (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && map->l_name[0]) path = map->l_name;
  char real[PATH_MAX];
  if (!realpath(path, real)) snprintf(real, sizeof real, "%s", path);
  printf("lib soname=%s path=%s real=%s mount=%s\n", soname, path, real, is_mount_point(path) ? "yes" : "no");
  return lib;
}

// Every path in /etc/ld.so.cache whose file name is `name`.
static void ldcache(void) {
  FILE *f = fopen("/etc/ld.so.cache", "rb");
  if (!f) {
    printf("ldcache error=1 name=%s\n", strerror(errno));
    return;
  }
  static char buf[8 << 20];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char *names[] = {"libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1"};
  for (size_t i = 0; i < n;) {
    const char *str = buf + i;
    size_t len = strnlen(str, n - i);
    if (len > 0 && str[0] == '/') {
      const char *base = strrchr(str, '/') + 1;
      for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        if (strcmp(base, names[k]) == 0) printf("ldcache file=%s path=%s\n", names[k], str);
    }
    i += len + 1;
  }
}

// The development link next to the loaded libcuda.so.1, and whether dlopen("libcuda.so") succeeds.
static void devlink(void *cuda) {
  struct link_map *map = NULL;
  if (!cuda || dlinfo(cuda, RTLD_DI_LINKMAP, &map) != 0 || !map || !map->l_name) return;
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s", map->l_name);
  char *slash = strrchr(path, '/');
  if (!slash) return;
  snprintf(slash + 1, sizeof path - (size_t)(slash + 1 - path), "libcuda.so");
  char target[PATH_MAX];
  ssize_t t = readlink(path, target, sizeof target - 1);
  if (t < 0) snprintf(target, sizeof target, "none");
  else target[t] = 0;
  void *dev = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  printf("devlink path=%s target=%s dlopen=%s\n", path, target, dev ? "ok" : "failed");
}

static void format_uuid(char *out, size_t len, const char *prefix, const unsigned char *b) {
  snprintf(out, len,
           "%s-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", prefix, b[0], b[1], b[2],
           b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

// --- NVML ---------------------------------------------------------------------------------------

static void probe_nvml(void *nvml) {
  nvmlReturn_t (*init)(void) = sym(nvml, "libnvidia-ml.so.1", "nvmlInit_v2");
  const char *(*error_string)(nvmlReturn_t) = sym(nvml, "libnvidia-ml.so.1", "nvmlErrorString");
  nvmlReturn_t (*driver_version)(char *, unsigned) = sym(nvml, "libnvidia-ml.so.1", "nvmlSystemGetDriverVersion");
  nvmlReturn_t (*count)(unsigned *) = sym(nvml, "libnvidia-ml.so.1", "nvmlDeviceGetCount_v2");
  nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t *) = sym(nvml, "libnvidia-ml.so.1", "nvmlDeviceGetHandleByIndex_v2");
  nvmlReturn_t (*uuid)(nvmlDevice_t, char *, unsigned) = sym(nvml, "libnvidia-ml.so.1", "nvmlDeviceGetUUID");
  nvmlReturn_t (*name)(nvmlDevice_t, char *, unsigned) = sym(nvml, "libnvidia-ml.so.1", "nvmlDeviceGetName");
  nvmlReturn_t (*mig_mode)(nvmlDevice_t, unsigned *, unsigned *) = sym(nvml, "libnvidia-ml.so.1", "nvmlDeviceGetMigMode");
  nvmlReturn_t (*max_mig)(nvmlDevice_t, unsigned *) = sym(nvml, "libnvidia-ml.so.1", "nvmlDeviceGetMaxMigDeviceCount");
  nvmlReturn_t (*mig_by_index)(nvmlDevice_t, unsigned, nvmlDevice_t *) =
      sym(nvml, "libnvidia-ml.so.1", "nvmlDeviceGetMigDeviceHandleByIndex");
  nvmlReturn_t (*shutdown)(void) = sym(nvml, "libnvidia-ml.so.1", "nvmlShutdown");
  if (!init || !count || !by_index || !uuid) return;
#define ERR(r) (error_string ? error_string(r) : "?")

  nvmlReturn_t r = init();
  printf("nvml.init rc=%d name=%s\n", r, ERR(r));
  if (r != 0) return;
  if (driver_version) {
    char v[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = "";
    r = driver_version(v, sizeof v);
    printf("nvml.driver rc=%d version=%s\n", r, v);
  }
  unsigned n = 0;
  r = count(&n);
  printf("nvml.count rc=%d count=%u\n", r, n);
  for (unsigned i = 0; r == 0 && i < n; i++) {
    nvmlDevice_t dev;
    nvmlReturn_t rd = by_index(i, &dev);
    if (rd != 0) {
      printf("nvml.gpu index=%u rc=%d name=%s\n", i, rd, ERR(rd));
      continue;
    }
    char u[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "", nm[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = "";
    uuid(dev, u, sizeof u);
    if (name) name(dev, nm, sizeof nm);
    unsigned current = 0, pending = 0, slots = 0;
    if (mig_mode && mig_mode(dev, &current, &pending) != 0) current = 0;
    if (current && max_mig && max_mig(dev, &slots) != 0) slots = 0;
    printf("nvml.gpu index=%u uuid=%s mig=%u migmax=%u name=%s\n", i, u, current, slots, nm);
    // Every slot is asked: a slot without a MIG device answers NOT_FOUND, and the visible ones need not
    // be the first.
    for (unsigned s = 0; mig_by_index && s < slots; s++) {
      nvmlDevice_t mig;
      if (mig_by_index(dev, s, &mig) != 0) continue;
      char mu[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "";
      nvmlReturn_t rm = uuid(mig, mu, sizeof mu);
      printf("nvml.mig gpu=%u index=%u rc=%d uuid=%s\n", i, s, rm, mu);
      if (rm == 0 && n_mig_uuids < MAX_UUIDS) snprintf(mig_uuids[n_mig_uuids++], sizeof mig_uuids[0], "%s", mu);
    }
  }
  if (shutdown) shutdown();
#undef ERR
}

// --- CUDA ---------------------------------------------------------------------------------------

static int probe_cuda(void *cuda) {
  CUresult (*init)(unsigned) = sym(cuda, "libcuda.so.1", "cuInit");
  CUresult (*error_name)(CUresult, const char **) = sym(cuda, "libcuda.so.1", "cuGetErrorName");
  CUresult (*driver_version)(int *) = sym(cuda, "libcuda.so.1", "cuDriverGetVersion");
  CUresult (*count)(int *) = sym(cuda, "libcuda.so.1", "cuDeviceGetCount");
  CUresult (*get)(CUdevice *, int) = sym(cuda, "libcuda.so.1", "cuDeviceGet");
  CUresult (*name)(char *, int, CUdevice) = sym(cuda, "libcuda.so.1", "cuDeviceGetName");
  CUresult (*total_mem)(size_t *, CUdevice) = sym(cuda, "libcuda.so.1", "cuDeviceTotalMem_v2");
  CUresult (*ctx_create)(CUcontext *, unsigned, CUdevice) = sym(cuda, "libcuda.so.1", "cuCtxCreate_v2");
  CUresult (*ctx_destroy)(CUcontext) = sym(cuda, "libcuda.so.1", "cuCtxDestroy_v2");
  CUresult (*attribute)(int *, int, CUdevice) = sym(cuda, "libcuda.so.1", "cuDeviceGetAttribute");
  CUresult (*mem_info)(size_t *, size_t *) = sym(cuda, "libcuda.so.1", "cuMemGetInfo_v2");
  CUresult (*exec_affinity)(CUexecAffinityParam *, int) = sym(cuda, "libcuda.so.1", "cuCtxGetExecAffinity");
  CUresult (*module_load)(CUmodule *, const void *) = sym(cuda, "libcuda.so.1", "cuModuleLoadData");
  CUresult (*module_unload)(CUmodule) = sym(cuda, "libcuda.so.1", "cuModuleUnload");
  // Optional: the newer entry point first (MIG UUIDs), else the original one.
  CUresult (*get_uuid)(CUuuid *, CUdevice) = dlsym(cuda, "cuDeviceGetUuid_v2");
  if (!get_uuid) get_uuid = sym(cuda, "libcuda.so.1", "cuDeviceGetUuid");
  CUresult (*mps_server)(CUcontext, int *) = dlsym(cuda, "tesseraSimCtxGetMpsServerPid");
  CUresult (*sm_share)(CUcontext, double *, int *) = dlsym(cuda, "tesseraSimCtxGetSmShare");
  if (!init) return 1;
#define ERR(r) (error_name && error_name(r, &en) == 0 && en ? en : "?")
  const char *en = NULL;

  CUresult r = init(0);
  printf("cuda.init rc=%d name=%s\n", r, ERR(r));
  if (r != 0) return 1;
  int v = 0;
  if (driver_version) {
    r = driver_version(&v);
    printf("cuda.driver rc=%d version=%d\n", r, v);
  }
  int n = 0;
  r = count ? count(&n) : -1;
  printf("cuda.count rc=%d count=%d\n", r, n);
  for (int i = 0; r == 0 && i < n && get; i++) {
    CUdevice dev;
    CUresult rd = get(&dev, i);
    if (rd != 0) {
      printf("cuda.device index=%d rc=%d name=%s\n", i, rd, ERR(rd));
      continue;
    }
    char nm[256] = "", u[64] = "?";
    size_t mem = 0;
    int sms = 0;
    if (name) name(nm, sizeof nm, dev);
    if (total_mem) total_mem(&mem, dev);
    if (attribute) attribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    CUuuid raw;
    if (get_uuid && get_uuid(&raw, dev) == 0) {
      char mig[64];
      format_uuid(u, sizeof u, "GPU", (unsigned char *)raw.bytes);
      format_uuid(mig, sizeof mig, "MIG", (unsigned char *)raw.bytes);
      for (int m = 0; m < n_mig_uuids; m++) {
        if (strcmp(mig_uuids[m], mig) == 0) snprintf(u, sizeof u, "%s", mig);
      }
    }
    printf("cuda.device index=%d uuid=%s mem=%zu sms=%d name=%s\n", i, u, mem, sms, nm);

    if (!ctx_create) continue;
    CUcontext ctx = NULL;
    CUresult rc = ctx_create(&ctx, 0, dev);
    char mps[64] = "unknown";
    size_t free_mem = 0, ctx_mem = 0;
    CUexecAffinityParam affinity = {0};
    if (rc == 0) {
      if (mps_server) {
        int pid = 0;
        if (mps_server(ctx, &pid) == 0)
          snprintf(mps, sizeof mps, "yes server=%d", pid);
        else
          snprintf(mps, sizeof mps, "no");
      }
      if (mem_info) mem_info(&free_mem, &ctx_mem);
      if (exec_affinity) exec_affinity(&affinity, CU_EXEC_AFFINITY_TYPE_SM_COUNT);
    }
    printf("cuda.ctx index=%d rc=%d mps=%s memtotal=%zu sms=%u name=%s\n", i, rc, mps, ctx_mem, affinity.param.smCount.val,
           ERR(rc));
    // Only where the simulated driver answers (an MPS context): the check container's termination message
    // has a 4096-byte limit, so direct contexts and NVIDIA's libcuda add no line.
    double share = 0;
    int busy = 0;
    if (rc == 0 && sm_share && sm_share(ctx, &share, &busy) == 0)
      printf("cuda.sm_share index=%d rc=0 share=%.3f busy=%d\n", i, share, busy);
    if (rc == 0 && module_load) {
      CUmodule module = NULL;
      CUresult rm = module_load(&module, probe_ptx);
      printf("cuda.module index=%d rc=%d name=%s\n", i, rm, ERR(rm));
      if (rm == 0 && module_unload) module_unload(module);
    }
    if (rc == 0 && ctx_destroy) ctx_destroy(ctx);
  }
  return 0;
#undef ERR
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  printf("probe version=1\n");
  const char *ld_path = getenv("LD_LIBRARY_PATH");
  printf("loader ld_library_path=%s\n", ld_path ? ld_path : "unset");
  void *cuda = load("libcuda.so.1");
  void *nvml = load("libnvidia-ml.so.1");
  // NVML first: its MIG devices tell which CUDA UUIDs are MIG UUIDs.
  if (nvml) probe_nvml(nvml);
  int code = cuda ? probe_cuda(cuda) : 2;
  ldcache();
  devlink(cuda);
  printf("exit code=%d\n", code);
  return code;
}
