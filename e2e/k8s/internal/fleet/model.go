package fleet

import "time"

// The service-time model's constants, all in one place. They are assumptions, not
// measurements; see doc.go for the reasoning and the figures they are checked against.
const (
	// DefaultPrefillTokensPerSecond is the prompt-processing rate of one whole
	// H100-class GPU for a 7–8B model (assumption, "on the order of 10k tokens/s").
	DefaultPrefillTokensPerSecond = 10000.0
	// DefaultDecodeSecondsPerToken is the time one sequence waits per generated
	// token at small batch on a whole GPU (assumption, 25 ms).
	DefaultDecodeSecondsPerToken = 0.025
	// DefaultBatchSlots is how many requests one replica serves at once
	// (continuous batching, small concurrency; assumption).
	DefaultBatchSlots = 8
)

// Model is the per-request service-time model. The zero value means the defaults.
type Model struct {
	PrefillTokensPerSecond float64
	DecodeSecondsPerToken  float64
	BatchSlots             int
}

// DefaultModel returns the model with the constants above.
func DefaultModel() Model {
	return Model{
		PrefillTokensPerSecond: DefaultPrefillTokensPerSecond,
		DecodeSecondsPerToken:  DefaultDecodeSecondsPerToken,
		BatchSlots:             DefaultBatchSlots,
	}
}

func (m Model) withDefaults() Model {
	d := DefaultModel()
	if m.PrefillTokensPerSecond <= 0 {
		m.PrefillTokensPerSecond = d.PrefillTokensPerSecond
	}
	if m.DecodeSecondsPerToken <= 0 {
		m.DecodeSecondsPerToken = d.DecodeSecondsPerToken
	}
	if m.BatchSlots <= 0 {
		m.BatchSlots = d.BatchSlots
	}
	return m
}

// WorkSeconds is the time the request holds one batch slot of a WHOLE GPU:
// prefill (ContextTokens / prefill rate) + decode (GeneratedTokens * per-token time).
func (m Model) WorkSeconds(r Request) float64 {
	m = m.withDefaults()
	return float64(r.ContextTokens)/m.PrefillTokensPerSecond + float64(r.GeneratedTokens)*m.DecodeSecondsPerToken
}

// ServiceTime is the request's time in service on a replica holding fraction
// (0,1] of a GPU: a share serves at rate fraction of a whole GPU (MPS
// active-thread-percentage assumption), so its service time is WorkSeconds/fraction.
func (m Model) ServiceTime(r Request, fraction float64) time.Duration {
	return seconds(m.WorkSeconds(r) / fraction)
}

// LoadGPUs is the whole-GPU capacity a stream of requests needs on average over
// span: total slot-seconds / (span * slots per GPU).
func (m Model) LoadGPUs(reqs []Request, span time.Duration) float64 {
	m = m.withDefaults()
	if span <= 0 {
		return 0
	}
	var w float64
	for _, r := range reqs {
		w += m.WorkSeconds(r)
	}
	return w / (span.Seconds() * float64(m.BatchSlots))
}

// PeakLoadGPUs is the largest LoadGPUs over any window of length window that
// starts at an arrival (requests must be sorted by At).
func (m Model) PeakLoadGPUs(reqs []Request, window time.Duration) float64 {
	m = m.withDefaults()
	if window <= 0 {
		return 0
	}
	var (
		best, sum float64
		j         int
	)
	for i := range reqs {
		for j < len(reqs) && reqs[j].At < reqs[i].At+window {
			sum += m.WorkSeconds(reqs[j])
			j++
		}
		if sum > best {
			best = sum
		}
		sum -= m.WorkSeconds(reqs[i])
	}
	return best / (window.Seconds() * float64(m.BatchSlots))
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
