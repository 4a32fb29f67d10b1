package main

import (
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/textparse"
	"google.golang.org/protobuf/proto"
)

// lint runs promlint, the linter behind `promtool check metrics`, on an exposition. promlint reads the
// Prometheus text format only, so the families come from Prometheus' own parser for the content type
// (OpenMetrics for tessera), named as the text format names them: a counter family by its `_total` samples.
func lint(body []byte, contentType string) ([]promlint.Problem, error) {
	p, err := textparse.New(body, contentType, labels.NewSymbolTable(), textparse.ParserOptions{})
	if err != nil {
		return nil, err
	}
	families := map[string]*dto.MetricFamily{}
	types := map[string]model.MetricType{}
	helps := map[string]string{}
	seen := map[string]bool{}
	family := func(name string) *dto.MetricFamily {
		if f, ok := families[name]; ok {
			return f
		}
		f := &dto.MetricFamily{Name: proto.String(name)}
		families[name] = f
		return f
	}
	for {
		entry, err := p.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		switch entry {
		case textparse.EntryType:
			name, kind := p.Type()
			types[string(name)] = kind
		case textparse.EntryHelp:
			name, help := p.Help()
			helps[string(name)] = string(help)
		case textparse.EntrySeries:
			var lset labels.Labels
			p.Labels(&lset)
			sample := lset.Get(labels.MetricName)
			base, kind := familyOf(sample, types)
			name := base
			metricType := dto.MetricType_UNTYPED
			switch kind {
			case model.MetricTypeCounter:
				name, metricType = sample, dto.MetricType_COUNTER
			case model.MetricTypeGauge:
				metricType = dto.MetricType_GAUGE
			case model.MetricTypeHistogram:
				metricType = dto.MetricType_HISTOGRAM
			}
			f := family(name)
			f.Type = metricType.Enum()
			if help, ok := helps[base]; ok {
				f.Help = proto.String(help)
			}
			// One metric per label set; a histogram's bucket, sum and count lines are one metric.
			var pairs []*dto.LabelPair
			key := name
			lset.Range(func(l labels.Label) {
				if l.Name == labels.MetricName || (metricType == dto.MetricType_HISTOGRAM && l.Name == "le") {
					return
				}
				pairs = append(pairs, &dto.LabelPair{Name: proto.String(l.Name), Value: proto.String(l.Value)})
				key += "," + l.Name + "=" + l.Value
			})
			if seen[key] {
				continue
			}
			seen[key] = true
			m := &dto.Metric{Label: pairs}
			switch metricType {
			case dto.MetricType_COUNTER:
				m.Counter = &dto.Counter{}
			case dto.MetricType_GAUGE:
				m.Gauge = &dto.Gauge{}
			case dto.MetricType_HISTOGRAM:
				m.Histogram = &dto.Histogram{}
			default:
				m.Untyped = &dto.Untyped{}
			}
			f.Metric = append(f.Metric, m)
		}
	}
	names := make([]string, 0, len(families))
	for n := range families {
		names = append(names, n)
	}
	sort.Strings(names)
	mfs := make([]*dto.MetricFamily, 0, len(names))
	for _, n := range names {
		mfs = append(mfs, families[n])
	}
	return promlint.NewWithMetricFamilies(mfs).Lint()
}

// familyOf finds the declared family of a sample name: itself, or itself less a suffix its type allows.
func familyOf(sample string, types map[string]model.MetricType) (string, model.MetricType) {
	if kind, ok := types[sample]; ok {
		return sample, kind
	}
	for _, suffix := range []string{"_total", "_created", "_bucket", "_sum", "_count"} {
		base := strings.TrimSuffix(sample, suffix)
		if kind, ok := types[base]; ok && base != sample {
			return base, kind
		}
	}
	return sample, model.MetricTypeUnknown
}

func formatProblems(target string, problems []promlint.Problem) string {
	var b strings.Builder
	for _, p := range problems {
		fmt.Fprintf(&b, "%s: %s: %s\n", target, p.Metric, p.Text)
	}
	return b.String()
}
