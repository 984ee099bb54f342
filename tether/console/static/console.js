// Charts of the console (uPlot) and their live updates. A chart element carries its data as JSON:
//   <div class="chart" data-chart='{"title": ..., "series": ["reward", ...], "data": [[x...], [y...], ...]}'>
//   ("labels", if given, names the series in the legend; "series" stays the metric names points carry)
// and, for a live one, data-live="/api/.../events": an EventSource whose "points" events carry
// {"x": step, "values": {"reward": 0.5, ...}} and are appended to every chart on the page with that series.
(function () {
  "use strict";
  const palette = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];
  const charts = [];

  function build(el) {
    const spec = JSON.parse(el.dataset.chart);
    const series = [{ label: spec.x || "step" }].concat(
      spec.series.map((name, i) => ({ label: (spec.labels || spec.series)[i], stroke: palette[i % palette.length], width: 1.5, spanGaps: true }))
    );
    const width = Math.max(300, el.clientWidth - 12);
    const title = document.createElement("div");
    title.className = "chart-title";
    title.textContent = spec.title;
    el.appendChild(title);
    const axes = [{}, { size: 58, values: (u, splits) => splits.map(tick) }];
    const options = { width: width, height: 190, series: series, axes: axes, scales: { x: { time: !!spec.time } } };
    const plot = new uPlot(options, spec.data, el);
    const entry = { el: el, spec: spec, plot: plot, data: spec.data };
    el.tetherChart = entry;
    charts.push(entry);
    return entry;
  }

  // y-axis ticks to three significant digits, so that a series of 1e-7s reads 1.0e-7, not 0
  function tick(value) {
    if (value === null || value === 0) return value === 0 ? "0" : "";
    const size = Math.abs(value);
    return size < 1e-3 || size >= 1e6 ? value.toExponential(1) : String(+value.toPrecision(3));
  }

  function append(point) {
    for (const entry of charts) {
      if (!spec_has_any(entry.spec, point.values)) continue;
      entry.data[0].push(point.x);
      entry.spec.series.forEach((name, i) => {
        const v = point.values[name];
        entry.data[i + 1].push(v === undefined ? null : v);
      });
      entry.plot.setData(entry.data);
      entry.el.dataset.points = String(entry.data[0].length);
    }
  }

  function spec_has_any(spec, values) {
    return spec.series.some((name) => Object.prototype.hasOwnProperty.call(values, name));
  }

  function init(root) {
    root.querySelectorAll(".chart[data-chart]").forEach((el) => {
      if (!el.tetherChart) { const entry = build(el); el.dataset.points = String(entry.data[0].length); }
    });
    root.querySelectorAll("[data-live]").forEach((el) => {
      if (el.tetherSource) return;
      const source = new EventSource(el.dataset.live);
      el.tetherSource = source;
      source.addEventListener("points", (event) => JSON.parse(event.data).forEach(append));
      source.addEventListener("end", () => source.close());
    });
  }

  window.tether = { init: init, charts: charts, append: append };
  document.addEventListener("DOMContentLoaded", () => init(document));
  document.addEventListener("htmx:afterSettle", (event) => init(event.target));
})();
