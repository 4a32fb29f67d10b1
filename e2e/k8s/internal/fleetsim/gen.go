package fleetsim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"time"

	"tessera.dev/e2e/internal/fleet"
)

// Generated traces: fixed seeds, one hour, token lengths lognormal around the conversation
// trace's medians (prompt ~1,000, output ~200; chosen, not fitted).
const genSeed = 20231116

// Generate makes the named trace: "gen:low" (Poisson, 1 request/s) or "gen:bursty" (Poisson at
// 4 requests/s with 60 s bursts at 5× every ~5 minutes, and a 10-minute surge at 2× in the middle).
func Generate(name string) ([]fleet.Request, error) {
	rng := rand.New(rand.NewPCG(genSeed, uint64(len(name))))
	rate := func(t float64) float64 { return 1 }
	switch name {
	case "gen:low":
	case "gen:bursty":
		rate = func(t float64) float64 {
			r := 4.0
			if math.Mod(t, 307) < 60 {
				r *= 5
			}
			if t >= 1500 && t < 2100 {
				r *= 2
			}
			return r
		}
	default:
		return nil, fmt.Errorf("trace %q: generated traces are gen:low and gen:bursty", name)
	}
	const span, peak = 3600.0, 40.0
	var out []fleet.Request
	for t := 0.0; ; {
		t += rng.ExpFloat64() / peak // thinning
		if t >= span {
			break
		}
		if rng.Float64()*peak > rate(t) {
			continue
		}
		ctx := int(math.Min(8000, math.Exp(math.Log(1000)+0.8*rng.NormFloat64())))
		gen := int(math.Min(2000, math.Exp(math.Log(200)+0.7*rng.NormFloat64())))
		out = append(out, fleet.Request{At: time.Duration(t * float64(time.Second)), ContextTokens: max(1, ctx), GeneratedTokens: max(1, gen)})
	}
	return out, nil
}

// WriteTrace writes reqs in the Azure format (TIMESTAMP,ContextTokens,GeneratedTokens).
func WriteTrace(path string, reqs []fleet.Request) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	base := time.Date(2023, 11, 16, 0, 0, 0, 0, time.UTC)
	fmt.Fprintln(f, "TIMESTAMP,ContextTokens,GeneratedTokens")
	for _, r := range reqs {
		fmt.Fprintf(f, "%s,%d,%d\n", base.Add(r.At).Format("2006-01-02 15:04:05.0000000"), r.ContextTokens, r.GeneratedTokens)
	}
	return f.Close()
}
