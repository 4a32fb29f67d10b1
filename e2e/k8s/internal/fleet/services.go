package fleet

import (
	"fmt"
	"sort"
	"time"
)

// Service is one inference service: a name and its requests in arrival order.
type Service struct {
	Name     string
	Requests []Request
}

// TraceSpan is the period the services wrap around: the last arrival plus one
// second, so that no two rows of the original trace collide after wrapping.
func TraceSpan(reqs []Request) time.Duration {
	if len(reqs) == 0 {
		return 0
	}
	return reqs[len(reqs)-1].At + time.Second
}

// SplitServices turns the one trace into n services deterministically.
//
// Service k takes the rows whose index i satisfies i%n == k (round-robin), and
// shifts their times by k*span/n, wrapping at span (TraceSpan). Round-robin alone
// would give n services with the same load curve in lock step, and shifting alone
// would copy every request n times (n times the real load). Together they keep the
// trace's total request count and token mix (each row is used exactly once), give
// each service 1/n of the rate, and put the services in different phases of the
// same bursty process, so their peaks do not coincide — the situation in which
// sharing GPUs between services can help. Names are "svc-0".."svc-(n-1)".
func SplitServices(reqs []Request, n int) []Service {
	if n < 1 {
		n = 1
	}
	span := TraceSpan(reqs)
	out := make([]Service, n)
	for k := range out {
		out[k].Name = fmt.Sprintf("svc-%d", k)
	}
	for i, r := range reqs {
		k := i % n
		shift := time.Duration(int64(span) / int64(n) * int64(k))
		r.At = (r.At + shift) % span
		out[k].Requests = append(out[k].Requests, r)
	}
	for k := range out {
		rs := out[k].Requests
		sort.SliceStable(rs, func(a, b int) bool { return rs[a].At < rs[b].At })
	}
	return out
}
