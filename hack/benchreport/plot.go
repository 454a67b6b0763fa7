package main

import (
	"bytes"
	"cmp"
	"fmt"
	"image/color"
	"math"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"

	"github.com/buildq/buildq/internal/benchfmt"
)

// title heads the plot.
const title = "buildq: latency against load (same-run baselines dashed)"

// Plot geometry: one panel per distinct pair of axis labels, stacked.
const (
	plotWidth   = 8 * vg.Inch
	panelHeight = 4 * vg.Inch
	titleHeight = 0.5 * vg.Inch
)

// panel is the series that share one pair of axis labels.
type panel struct {
	xLabel, yLabel string
	entries        []entry
}

type entry struct {
	label  string
	series benchfmt.Series
}

// plotSVG draws every series of results, one panel per (XLabel, YLabel)
// pair in order of first appearance, and returns the SVG; nil when there
// is nothing to plot. skipped names the series left out for having no
// points.
func plotSVG(results []benchfmt.Result) (svg []byte, skipped []string, err error) {
	panels, skipped := panelsOf(results)
	if len(panels) == 0 {
		return nil, skipped, nil
	}
	plots := make([][]*plot.Plot, len(panels))
	for i, pn := range panels {
		p, err := pn.plot()
		if err != nil {
			return nil, nil, err
		}
		plots[i] = []*plot.Plot{p}
	}
	c := vgsvg.New(plotWidth, titleHeight+vg.Length(len(panels))*panelHeight)
	drawPanels(draw.New(c), plots)

	var buf bytes.Buffer
	if _, err := c.WriteTo(&buf); err != nil {
		return nil, nil, err
	}
	return buf.Bytes(), skipped, nil
}

// panelsOf groups the series of results by their axis labels, labelling
// each with its result's id; skipped are the series with no points.
func panelsOf(results []benchfmt.Result) (panels []*panel, skipped []string) {
	for _, r := range results {
		for _, s := range r.Series {
			label := s.Name
			if !strings.HasPrefix(label, r.ID) {
				label = strings.TrimSpace(r.ID + " " + label)
			}
			if len(s.Points) == 0 {
				skipped = append(skipped, label)
				continue
			}
			i := slices.IndexFunc(panels, func(p *panel) bool { return p.xLabel == s.XLabel && p.yLabel == s.YLabel })
			if i < 0 {
				i = len(panels)
				panels = append(panels, &panel{xLabel: s.XLabel, yLabel: s.YLabel})
			}
			panels[i].entries = append(panels[i].entries, entry{label: label, series: s})
		}
	}
	return panels, skipped
}

// drawPanels draws the title and plots, one above the other, onto dc.
func drawPanels(dc draw.Canvas, plots [][]*plot.Plot) {
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())
	sty := plot.New().Title.TextStyle
	sty.Font.Size = vg.Points(14)
	dc.FillText(sty, vg.Point{X: dc.Center().X, Y: dc.Max.Y - vg.Points(10)}, title)

	tiles := draw.Tiles{
		Rows:      len(plots),
		Cols:      1,
		PadTop:    titleHeight,
		PadBottom: vg.Points(6),
		PadLeft:   vg.Points(6),
		PadRight:  vg.Points(12),
		PadY:      vg.Points(18),
	}
	canvases := plot.Align(plots, tiles, dc)
	for i := range plots {
		plots[i][0].Draw(canvases[i][0])
	}
}

// dashes is how a baseline's line is drawn.
var dashes = []vg.Length{vg.Points(6), vg.Points(3)}

func (pn *panel) plot() (*plot.Plot, error) {
	p := plot.New()
	p.X.Label.Text = pn.xLabel
	p.Y.Label.Text = pn.yLabel
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.Padding = vg.Points(4)
	p.Add(plotter.NewGrid())
	for i, e := range pn.entries {
		xys := make(plotter.XYs, len(e.series.Points))
		for j, pt := range e.series.Points {
			xys[j] = plotter.XY{X: pt.X, Y: pt.Y}
		}
		// A curve against load reads left to right, whatever order the
		// benchmark measured it in.
		slices.SortStableFunc(xys, func(a, b plotter.XY) int { return cmp.Compare(a.X, b.X) })
		line, points, err := plotter.NewLinePoints(xys)
		if err != nil {
			return nil, fmt.Errorf("series %q: %w", e.label, err)
		}
		col := plotutil.Color(i)
		line.Color = col
		line.Width = vg.Points(1.5)
		if strings.Contains(strings.ToLower(e.series.Name), "baseline") {
			line.Dashes = dashes
		}
		points.Color = col
		points.Shape = plotutil.Shape(i)
		points.Radius = vg.Points(2.5)
		p.Add(line, points)
		p.Legend.Add(e.label, line, points)
	}
	// Load and latency start at zero; an axis that does not hides how
	// close two curves really are.
	p.X.Min = math.Min(p.X.Min, 0)
	p.Y.Min = math.Min(p.Y.Min, 0)
	return p, nil
}
