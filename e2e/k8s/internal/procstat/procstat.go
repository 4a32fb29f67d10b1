// Package procstat reads what the benchmarks report about processes and the machine from /proc: a
// process's memory and the load average a run was measured under.
package procstat

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// RSS is the resident set size of process pid (VmRSS), in bytes.
func RSS(pid int) (int64, error) { return statusBytes(pid, "VmRSS:") }

// HighWaterMark is the peak resident set size of process pid so far (VmHWM), in bytes.
func HighWaterMark(pid int) (int64, error) { return statusBytes(pid, "VmHWM:") }

func statusBytes(pid int, field string) (int64, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if rest, ok := strings.CutPrefix(line, field); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb * 1024, err
		}
	}
	return 0, errors.New("no " + field + " in /proc/" + strconv.Itoa(pid) + "/status")
}

// LoadAverage is /proc/loadavg's 1-, 5- and 15-minute averages as "a / b / c": on a shared 2-core
// machine a benchmark's numbers mean little without it.
func LoadAverage() string {
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(raw))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " / ")
}

// Sleep waits d or until ctx is done, whichever is first; ctx's error in the second case.
func Sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}
