// promcheck scrapes tessera's /metrics endpoints into a Prometheus TSDB and evaluates a PromQL query
// against it, with Prometheus' own code: the exposition parser of its scrape loop (model/textparse, chosen
// by the Content-Type the target answers with, as the scrape loop chooses it), its TSDB (tsdb) and its
// PromQL engine (promql). It prints the query's result as JSON, for the e2e scenarios to assert on.
//
//	promcheck --target http://127.0.0.1:18600/metrics --target ... --scrapes 3 --interval 1s \
//	    --query 'avg(tessera_claim_gpu_utilization_ratio{namespace="x"})'
//
// Each target gets the labels job="tessera" and instance="<host:port>", as a scrape config would give it.
// A target whose exposition does not parse fails the run, naming the target and the parser's error.
//
//	promcheck --lint --target URL ...
//
// instead runs promlint (what `promtool check metrics` runs) on each target's metric names, labels and help,
// printing every problem and failing if there is one.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/textparse"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/tsdb"
)

// The Accept header of Prometheus' scrape loop for its default scrape protocols (OpenMetrics first).
const acceptHeader = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"

type targets []string

func (t *targets) String() string     { return strings.Join(*t, ",") }
func (t *targets) Set(v string) error { *t = append(*t, v); return nil }

// Sample is one element of the query's instant vector (or the scalar, with no metric).
type Sample struct {
	Metric map[string]string `json:"metric"`
	Value  float64           `json:"value"`
}

// Report is what promcheck prints.
type Report struct {
	Query   string   `json:"query"`
	Samples int      `json:"samplesScraped"`
	Result  []Sample `json:"result"`
}

func main() {
	var tgts targets
	flag.Var(&tgts, "target", "URL of a /metrics endpoint (repeatable)")
	query := flag.String("query", "", "PromQL expression evaluated at the time of the last scrape")
	scrapes := flag.Int("scrapes", 2, "scrapes of every target")
	interval := flag.Duration("interval", time.Second, "time between scrapes")
	lintOnly := flag.Bool("lint", false, "lint the targets' metrics (promlint) instead of querying")
	flag.Parse()
	if len(tgts) == 0 || (*query == "") == !*lintOnly {
		fmt.Fprintln(os.Stderr, "usage: promcheck --target URL [--target URL ...] (--query PROMQL | --lint)")
		os.Exit(2)
	}
	if *lintOnly {
		failed := false
		for _, target := range tgts {
			body, contentType, err := fetch(context.Background(), target)
			if err == nil {
				var problems []promlint.Problem
				problems, err = lint(body, contentType)
				if len(problems) > 0 {
					fmt.Print(formatProblems(target, problems))
					failed = true
				}
			}
			if err != nil {
				fmt.Fprintf(os.Stderr, "promcheck: lint %s: %v\n", target, err)
				failed = true
			}
		}
		if failed {
			os.Exit(1)
		}
		return
	}
	report, err := run(context.Background(), tgts, *query, *scrapes, *interval)
	if err != nil {
		fmt.Fprintln(os.Stderr, "promcheck:", err)
		os.Exit(1)
	}
	out, _ := json.MarshalIndent(report, "", "  ")
	fmt.Println(string(out))
}

func run(ctx context.Context, tgts []string, query string, scrapes int, interval time.Duration) (*Report, error) {
	if _, err := parser.NewParser(parser.Options{}).ParseExpr(query); err != nil {
		return nil, fmt.Errorf("--query %q: %w", query, err)
	}
	dir, err := os.MkdirTemp("", "promcheck-tsdb-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	db, err := tsdb.Open(dir, nil, nil, tsdb.DefaultOptions(), nil)
	if err != nil {
		return nil, fmt.Errorf("open TSDB: %w", err)
	}
	defer db.Close()

	report := &Report{Query: query}
	var last time.Time
	for i := 0; i < scrapes; i++ {
		if i > 0 {
			time.Sleep(interval)
		}
		last = time.Now()
		for _, target := range tgts {
			n, err := scrape(ctx, db, target, last)
			if err != nil {
				return nil, fmt.Errorf("scrape %s: %w", target, err)
			}
			report.Samples += n
		}
	}

	engine := promql.NewEngine(promql.EngineOpts{
		MaxSamples:    1_000_000,
		Timeout:       time.Minute,
		LookbackDelta: 5 * time.Minute,
	})
	q, err := engine.NewInstantQuery(ctx, db, nil, query, last)
	if err != nil {
		return nil, fmt.Errorf("query %q: %w", query, err)
	}
	defer q.Close()
	res := q.Exec(ctx)
	if res.Err != nil {
		return nil, fmt.Errorf("query %q: %w", query, res.Err)
	}
	switch v := res.Value.(type) {
	case promql.Vector:
		for _, s := range v {
			report.Result = append(report.Result, Sample{Metric: s.Metric.Map(), Value: s.F})
		}
	case promql.Scalar:
		report.Result = append(report.Result, Sample{Value: v.V})
	default:
		return nil, fmt.Errorf("query %q: a %s, not an instant vector or scalar", query, res.Value.Type())
	}
	if report.Result == nil {
		report.Result = []Sample{}
	}
	return report, nil
}

// fetch GETs one target as the scrape loop does: its body and Content-Type.
func fetch(ctx context.Context, target string) ([]byte, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, "", err
	}
	req.Header.Set("Accept", acceptHeader)
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, "", err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, "", fmt.Errorf("HTTP %d: %s", resp.StatusCode, strings.TrimSpace(string(body)))
	}
	return body, resp.Header.Get("Content-Type"), nil
}

// scrape fetches one target and appends its float samples at time at, the way the scrape loop does.
func scrape(ctx context.Context, db *tsdb.DB, target string, at time.Time) (int, error) {
	u, err := url.Parse(target)
	if err != nil {
		return 0, err
	}
	body, contentType, err := fetch(ctx, target)
	if err != nil {
		return 0, err
	}
	p, err := textparse.New(body, contentType, labels.NewSymbolTable(), textparse.ParserOptions{})
	if err != nil {
		return 0, fmt.Errorf("content type %q: %w", contentType, err)
	}
	app := db.Appender(ctx)
	ts := at.UnixMilli()
	n := 0
	for {
		entry, err := p.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			_ = app.Rollback()
			return 0, fmt.Errorf("parse (%s): %w", contentType, err)
		}
		if entry != textparse.EntrySeries {
			continue
		}
		_, _, v := p.Series()
		var lset labels.Labels
		p.Labels(&lset)
		b := labels.NewBuilder(lset)
		b.Set("job", "tessera")
		b.Set("instance", u.Host)
		if math.IsNaN(v) {
			continue
		}
		if _, err := app.Append(0, b.Labels(), ts, v); err != nil {
			_ = app.Rollback()
			return 0, fmt.Errorf("append %s: %w", lset, err)
		}
		n++
	}
	return n, app.Commit()
}
