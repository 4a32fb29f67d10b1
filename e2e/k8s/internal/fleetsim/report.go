package fleetsim

import (
	"fmt"
	"html"
	"strings"

	"tessera.dev/e2e/internal/fleet"
)

// Row is one policy's line of the results table.
type Row struct {
	Result
	Attain Attainment
}

// RunAll runs the baseline, sets the SLOs from it, then runs every other policy on the same trace.
func RunAll(cfg Config, trace []fleet.Request, policies []Policy) ([]Row, []SLO) {
	var rows []Row
	var slos []SLO
	for i, p := range policies {
		r := Run(cfg, trace, p)
		if i == 0 {
			slos = SLOsFrom(r, cfg.Services, cfg.SLOSlack)
		}
		rows = append(rows, Row{Result: r, Attain: Attain(r, slos)})
	}
	return rows, slos
}

// Table renders rows as markdown.
func Table(rows []Row) string {
	var b strings.Builder
	b.WriteString("| policy | GPU_UTIL of GPUs held: mean | p10 | p50 | p90 | SM active: mean | p10 | p50 | p90 | GPU-hours | max GPUs | SLO attainment: TTFT | per-token | both | pods created | to Ready p50 |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %d | %.4f | %.4f | %.4f | %d | %.1f s |\n",
			r.Policy.Name, r.GPUUtil.Mean, r.GPUUtil.P10, r.GPUUtil.P50, r.GPUUtil.P90,
			r.SMActive.Mean, r.SMActive.P10, r.SMActive.P50, r.SMActive.P90, r.GPUHours, r.MaxGPUs,
			r.Attain.TTFT, r.Attain.TPOT, r.Attain.Both, r.PodsCreated, r.ReadySecondsP50)
	}
	return b.String()
}

// SVG plots mean GPU_UTIL (y) against SLO attainment, both (x), one labelled point per policy.
func SVG(title string, rows []Row) string {
	const w, h, l, rt, t, bm = 640.0, 420.0, 70.0, 20.0, 40.0, 50.0
	minX := 1.0
	for _, r := range rows {
		minX = min(minX, r.Attain.Both)
	}
	minX = max(0, float64(int(minX*20))/20-0.05)
	x := func(v float64) float64 { return l + (v-minX)/(1-minX)*(w-l-rt) }
	y := func(v float64) float64 { return h - bm - v*(h-t-bm) }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="11">`+"\n", w, h)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/><text x="%.0f" y="20" font-size="13">%s</text>`+"\n", l, html.EscapeString(title))
	fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/><line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n",
		l, h-bm, w-rt, h-bm, l, h-bm, l, t)
	for v := 0.0; v <= 1.0001; v += 0.1 {
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end">%.1f</text><line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n",
			l-5, y(v)+4, v, l, y(v), w-rt, y(v))
	}
	for v := minX; v <= 1.0001; v += (1 - minX) / 5 {
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%.3f</text>`+"\n", x(v), h-bm+15, v)
	}
	fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="red" stroke-dasharray="4"/><text x="%.1f" y="%.1f" fill="red">70 %% GPU_UTIL</text>`+"\n",
		l, y(0.7), w-rt, y(0.7), l+5, y(0.7)-4)
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">SLO attainment (TTFT and per-token within the whole-peak-derived SLO)</text>`+"\n", (l+w-rt)/2, h-12)
	fmt.Fprintf(&b, `<text transform="translate(16,%.1f) rotate(-90)" text-anchor="middle">GPU_UTIL of GPUs held, mean</text>`+"\n", (h-bm+t)/2)
	for i, r := range rows {
		fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="4" fill="steelblue"/><text x="%.1f" y="%.1f">%s</text>`+"\n",
			x(r.Attain.Both), y(r.GPUUtil.Mean), x(r.Attain.Both)+6, y(r.GPUUtil.Mean)-4+float64(i%3)*10, html.EscapeString(r.Policy.Name))
	}
	b.WriteString("</svg>\n")
	return b.String()
}
