package fleet

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Request is one row of the Azure LLM inference trace.
type Request struct {
	// At is the arrival time, measured from the first row of the trace.
	At time.Duration
	// ContextTokens is the prompt length (prefill work).
	ContextTokens int
	// GeneratedTokens is the output length (decode work).
	GeneratedTokens int
}

// traceHeader is the header the Azure 2023 traces carry.
const traceHeader = "TIMESTAMP,ContextTokens,GeneratedTokens"

// traceTimeLayout accepts the trace's 7 fractional digits (and any other number of them).
const traceTimeLayout = "2006-01-02 15:04:05.999999999"

// ReadTrace reads an Azure LLM inference trace CSV (header
// TIMESTAMP,ContextTokens,GeneratedTokens, CRLF or LF line ends). Rows must be in
// non-decreasing time order, as the published trace is. Errors name the file, the
// 1-based line and the field.
func ReadTrace(path string) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()

	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	var (
		out   []Request
		first time.Time
		prev  time.Time
		line  int
	)
	for sc.Scan() {
		line++
		text := strings.TrimRight(sc.Text(), "\r")
		if line == 1 {
			text = strings.TrimPrefix(text, "\ufeff")
			if strings.ReplaceAll(text, " ", "") != traceHeader {
				return nil, fmt.Errorf("%s:%d: header: got %q, want %q", path, line, text, traceHeader)
			}
			continue
		}
		if strings.TrimSpace(text) == "" {
			continue
		}
		fields := strings.Split(text, ",")
		if len(fields) != 3 {
			return nil, fmt.Errorf("%s:%d: got %d fields, want 3 (TIMESTAMP,ContextTokens,GeneratedTokens)", path, line, len(fields))
		}
		ts, err := time.Parse(traceTimeLayout, strings.TrimSpace(fields[0]))
		if err != nil {
			return nil, fmt.Errorf("%s:%d: TIMESTAMP: %v", path, line, err)
		}
		ctx, err := parseTokens(fields[1])
		if err != nil {
			return nil, fmt.Errorf("%s:%d: ContextTokens: %v", path, line, err)
		}
		gen, err := parseTokens(fields[2])
		if err != nil {
			return nil, fmt.Errorf("%s:%d: GeneratedTokens: %v", path, line, err)
		}
		if len(out) == 0 {
			first, prev = ts, ts
		}
		if ts.Before(prev) {
			return nil, fmt.Errorf("%s:%d: TIMESTAMP: %s is before the previous row's %s (trace must be in time order)",
				path, line, ts.Format(traceTimeLayout), prev.Format(traceTimeLayout))
		}
		prev = ts
		out = append(out, Request{At: ts.Sub(first), ContextTokens: ctx, GeneratedTokens: gen})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s:%d: %v", path, line+1, err)
	}
	if line == 0 {
		return nil, fmt.Errorf("%s:1: header: file is empty", path)
	}
	return out, nil
}

func parseTokens(s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return 0, err
	}
	if n < 0 {
		return 0, fmt.Errorf("negative token count %d", n)
	}
	return n, nil
}
