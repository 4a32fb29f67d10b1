package e2etest

// What the CUDA probe (e2e/images/cuda-probe.c) prints inside a real-node container, parsed, and the
// checks every real-node workload's view must pass: the claim's devices and no others, through the
// driver's libraries as the loader found them.

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
)

// driverLibraryDir is where the CDI spec mounts the driver's libraries in a container (the host path under
// the driver root, one of the loader's default directories) and so where dlopen by soname must find them.
const driverLibraryDir = "/usr/lib/x86_64-linux-gnu"

// probeLib is a `lib` line: which file the dynamic loader opened for a soname.
type probeLib struct {
	path, real string
	mounted    bool
	err        string
}

type probeCUDADevice struct {
	uuid, name string
	mem        uint64
	sms        int
}

// probeCtx is a context the probe created: through an MPS server or not, and the memory and SMs it may use.
type probeCtx struct {
	rc        int
	mps, name string // mps: "yes server=<pid>", "no" or "unknown"
	memTotal  uint64
	sms       int
}

// probeModule is the PTX module the probe loaded in a context: CUDA_SUCCESS only when the driver's PTX JIT
// compiler (libnvidia-ptxjitcompiler.so.1) is in the container.
type probeModule struct {
	index, rc int
	name      string
}

type probeNVMLGPU struct {
	uuid string
	mig  bool
}

// probeView is everything the probe printed.
type probeView struct {
	libs       map[string]probeLib
	cudaInit   int
	cudaCount  int
	cuda       []probeCUDADevice
	ctx        []probeCtx
	modules    []probeModule
	nvmlInit   int
	nvml       []probeNVMLGPU
	migs       []string // MIG device UUIDs NVML lists
	missing    []string // symbols the probe did not find
	exit       int
	seenFields bool
}

// probeFields splits `fact k=v k=v name=free text` into the fact and its fields; `name=` takes the rest
// of the line (device names and error strings have spaces).
func probeFields(line string) (string, map[string]string) {
	fact, rest, _ := strings.Cut(line, " ")
	fields := map[string]string{}
	for rest != "" {
		if v, ok := strings.CutPrefix(rest, "name="); ok {
			fields["name"] = v
			break
		}
		var tok string
		tok, rest, _ = strings.Cut(rest, " ")
		if k, v, ok := strings.Cut(tok, "="); ok {
			fields[k] = v
		}
	}
	return fact, fields
}

func atoi(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		return -1
	}
	return n
}

// parseProbe reads the probe's lines (the `probe ` prefix already stripped).
func parseProbe(lines []string) probeView {
	v := probeView{libs: map[string]probeLib{}, cudaInit: -1, cudaCount: -1, nvmlInit: -1, exit: -1}
	for _, line := range lines {
		fact, f := probeFields(line)
		v.seenFields = true
		switch fact {
		case "lib":
			v.libs[f["soname"]] = probeLib{path: f["path"], real: f["real"], mounted: f["mount"] == "yes", err: f["name"]}
		case "cuda.init":
			v.cudaInit = atoi(f["rc"])
		case "cuda.count":
			if f["rc"] == "0" {
				v.cudaCount = atoi(f["count"])
			}
		case "cuda.device":
			mem, _ := strconv.ParseUint(f["mem"], 10, 64)
			v.cuda = append(v.cuda, probeCUDADevice{uuid: f["uuid"], name: f["name"], mem: mem, sms: atoi(f["sms"])})
		case "cuda.ctx":
			mps := f["mps"]
			if s, ok := f["server"]; ok {
				mps += " server=" + s
			}
			total, _ := strconv.ParseUint(f["memtotal"], 10, 64)
			v.ctx = append(v.ctx, probeCtx{rc: atoi(f["rc"]), mps: mps, name: f["name"], memTotal: total, sms: atoi(f["sms"])})
		case "cuda.module":
			v.modules = append(v.modules, probeModule{index: atoi(f["index"]), rc: atoi(f["rc"]), name: f["name"]})
		case "nvml.init":
			v.nvmlInit = atoi(f["rc"])
		case "nvml.gpu":
			v.nvml = append(v.nvml, probeNVMLGPU{uuid: f["uuid"], mig: f["mig"] == "1"})
		case "nvml.mig":
			v.migs = append(v.migs, f["uuid"])
		case "missing":
			v.missing = append(v.missing, f["symbol"])
		case "exit":
			v.exit = atoi(f["code"])
		}
	}
	return v
}

func (v probeView) cudaUUIDs() []string {
	var out []string
	for _, d := range v.cuda {
		out = append(out, d.uuid)
	}
	return sorted(out)
}

func (v probeView) nvmlUUIDs() []string {
	var out []string
	for _, g := range v.nvml {
		out = append(out, g.uuid)
	}
	return sorted(out)
}

func sorted(s []string) []string {
	out := append([]string(nil), s...)
	sort.Strings(out)
	return out
}

func dedup(s []string) []string {
	var out []string
	for i, x := range s {
		if i == 0 || x != s[i-1] {
			out = append(out, x)
		}
	}
	return out
}

// expectedView is what a container holding a claim's devices must see, from the claim's allocation, the
// slices and (for a MIG device's own UUID, which exists only once prepare made the instance) the node's
// hardware state: CUDA enumerates each whole or shared GPU by its UUID and each MIG device by its own MIG- UUID
// (not its parent); NVML lists the parent GPUs and, under a MIG-enabled one, the claim's MIG devices.
type expectedView struct {
	cuda, nvmlGPUs, nvmlMigs []string
	// A share, or a device whose claim's config asks for MPS: every context is an MPS client, limited to
	// the claim's memory and its compute percentage of the SMs (the share's CUDA_MPS_* env, which the
	// scenario compares with the claim's capacity or config).
	shared      bool
	memoryLimit uint64
	percentage  int
}

// mpsClient says the claim's config makes its (exclusive) devices one-holder MPS shares, as a MigConfig or
// GpuConfig with `sharing: {strategy: MPS}` does: its contexts must be MPS clients like a share's.
func expectFor(t *testing.T, p *v1.Pod, v seen, devices []resourcev1.DeviceRequestAllocationResult,
	migUUID func(t *testing.T, device string) string, mpsClient bool) expectedView {
	t.Helper()
	x := expectedView{shared: mpsClient}
	for _, r := range devices {
		d := sliceDevice(t, p.Spec.NodeName, r.Device)
		uuid := attr(d, "uuid").StringValue
		if uuid == nil {
			t.Fatalf("device %s has no uuid attribute", r.Device)
		}
		// The slice's uuid of a MIG device is its parent's (api/src/attributes.rs).
		x.nvmlGPUs = append(x.nvmlGPUs, *uuid)
		if migDevice.MatchString(r.Device) {
			mig := migUUID(t, r.Device)
			x.cuda = append(x.cuda, mig)
			x.nvmlMigs = append(x.nvmlMigs, mig)
		} else {
			x.cuda = append(x.cuda, *uuid)
		}
		x.shared = x.shared || sharedName.MatchString(r.Device)
	}
	if x.shared {
		x.memoryLimit = uint64(mpsLimitBytes(v.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]))
		x.percentage = atoi(v.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
	}
	// Two MIG devices of one GPU share their parent.
	x.cuda, x.nvmlGPUs, x.nvmlMigs = sorted(x.cuda), dedup(sorted(x.nvmlGPUs)), sorted(x.nvmlMigs)
	return x
}

// checkProbe asserts the probe's view: the driver's libraries resolved by the loader from the CDI mounts,
// cuInit and a context on every device, and exactly the expected devices through both CUDA and NVML.
func checkProbe(t *testing.T, p *v1.Pod, v seen, want expectedView) {
	t.Helper()
	fail := func(format string, args ...any) {
		t.Errorf("pod %s: cuda-probe: "+format+"\n--- the container printed:\n%s", append([]any{p.Name}, append(args, v.raw)...)...)
	}
	pv := v.probe
	if !pv.seenFields {
		fail("printed nothing")
		return
	}
	for _, soname := range []string{"libcuda.so.1", "libnvidia-ml.so.1"} {
		l, ok := pv.libs[soname]
		want := driverLibraryDir + "/" + soname
		switch {
		case !ok || l.err != "":
			fail("dlopen(%q) failed: %s", soname, l.err)
		case l.path != want:
			fail("the loader resolved %s to %s, want %s", soname, l.path, want)
		case !l.mounted:
			fail("%s (%s) is not a mount in the container: not the driver's file from the CDI spec", soname, l.path)
		}
	}
	if len(pv.missing) > 0 {
		fail("the driver lacks %v", pv.missing)
	}
	if pv.cudaInit != 0 || pv.exit != 0 {
		fail("cuInit returned %d (probe exit %d), want 0", pv.cudaInit, pv.exit)
		return
	}
	if pv.cudaCount != len(want.cuda) {
		fail("cuDeviceGetCount = %d, want %d (%v)", pv.cudaCount, len(want.cuda), want.cuda)
	}
	if got := pv.cudaUUIDs(); !equal(got, want.cuda) {
		fail("CUDA devices %v, want exactly the claim's %v", got, want.cuda)
	}
	for i, d := range pv.cuda {
		if d.mem == 0 || d.name == "" {
			fail("CUDA device %d (%s): name %q, %d bytes of memory", i, d.uuid, d.name, d.mem)
		}
	}
	if len(pv.ctx) != len(pv.cuda) {
		fail("%d contexts for %d devices", len(pv.ctx), len(pv.cuda))
	}
	for i, c := range pv.ctx {
		if c.rc != 0 {
			fail("cuCtxCreate on device %d returned %d (%s), want CUDA_SUCCESS", i, c.rc, c.name)
			continue
		}
		d := pv.cuda[min(i, len(pv.cuda)-1)]
		switch {
		case !want.shared && c.mps != "no":
			fail("the context on device %d of a claim without MPS says mps=%s, want no", i, c.mps)
		case !want.shared && (c.memTotal != d.mem || c.sms != d.sms):
			fail("the direct context on device %d may use %d bytes and %d SMs, want the device's %d and %d", i, c.memTotal, c.sms, d.mem, d.sms)
		case want.shared && !strings.HasPrefix(c.mps, "yes server="):
			fail("the share's context on device %d is not an MPS client (mps=%s)", i, c.mps)
		case want.shared && c.memTotal != want.memoryLimit:
			fail("the share's MPS context on device %d has %d bytes, want the claim's pinned limit %d", i, c.memTotal, want.memoryLimit)
		case want.shared && c.sms != (d.sms*want.percentage+99)/100:
			fail("the share's MPS context on device %d may use %d of %d SMs, want %d %%", i, c.sms, d.sms, want.percentage)
		}
	}
	// A PTX module per context: the driver's JIT libraries are in the container (a spec without
	// libnvidia-ptxjitcompiler.so.1 answers 221, CUDA_ERROR_JIT_COMPILER_NOT_FOUND).
	created := 0
	for _, c := range pv.ctx {
		if c.rc == 0 {
			created++
		}
	}
	if len(pv.modules) != created {
		fail("%d PTX module loads for %d contexts", len(pv.modules), created)
	}
	for _, m := range pv.modules {
		if m.rc != 0 {
			fail("cuModuleLoadData of PTX on device %d returned %d (%s), want CUDA_SUCCESS: the container lacks the driver's PTX JIT compiler", m.index, m.rc, m.name)
		}
	}
	if pv.nvmlInit != 0 {
		fail("nvmlInit_v2 returned %d, want 0", pv.nvmlInit)
	}
	if got := pv.nvmlUUIDs(); !equal(got, want.nvmlGPUs) {
		fail("NVML GPUs %v, want exactly the claim's %v", got, want.nvmlGPUs)
	}
	if got := sorted(pv.migs); !equal(got, want.nvmlMigs) {
		fail("NVML MIG devices %v, want exactly the claim's %v", got, want.nvmlMigs)
	}
	// nvidia-smi -L: one `GPU <i>:` line per GPU the container holds, each with its UUID, and the MIG
	// devices under them.
	gpuLines := 0
	for _, line := range strings.Split(v.smi, "\n") {
		if strings.HasPrefix(line, "GPU ") {
			gpuLines++
		}
	}
	if gpuLines != len(want.nvmlGPUs) {
		fail("nvidia-smi -L lists %d GPUs, want %d (%v)", gpuLines, len(want.nvmlGPUs), want.nvmlGPUs)
	}
	for _, u := range append(append([]string{}, want.nvmlGPUs...), want.nvmlMigs...) {
		if !strings.Contains(v.smi, u) {
			fail("nvidia-smi -L does not list %s", u)
		}
	}
}

func equal(a, b []string) bool {
	return fmt.Sprint(a) == fmt.Sprint(b)
}
