// memlm dashboard: draws /admin/stats/history with plotly.js and polls it for updates.
// Text goes in with textContent only (never innerHTML): the data holds document titles.
(function () {
  "use strict";

  var COLORS = {
    day: "#4c78a8", cumulative: "#f58518", fullmem: "#9d9d9d", lm: "#9d9d9d",
    aug: "#54a24b", entries: "#4c78a8", disk: "#e45756", ram: "#b279a2",
    speed: "#4c78a8", throughput: "#bab0ac", build: "#72b7b2",
  };
  var STATUS_COLORS = {
    pending: "#f2cf5b", processing: "#4c78a8", done: "#54a24b", failed: "#e45756",
    forgetting: "#b279a2", forgotten: "#9d9d9d",
  };
  var BASE = {
    margin: { l: 60, r: 60, t: 8, b: 36 },
    height: 250,
    legend: { orientation: "h", x: 0, y: 1.12 },
    font: { family: "system-ui, -apple-system, Segoe UI, sans-serif", size: 12, color: "#333" },
    paper_bgcolor: "rgba(0,0,0,0)",
    plot_bgcolor: "rgba(0,0,0,0)",
    hovermode: "x unified",
  };
  var CONFIG = { displaylogo: false, responsive: true, displayModeBar: false };
  // Stream days side by side (a stream's days need not be consecutive dates).
  var DAY_AXIS = { type: "category", tickangle: -30, automargin: true };
  var STATUSES = ["pending", "processing", "done", "failed", "forgetting", "forgotten"];

  function $(id) { return document.getElementById(id); }
  function num(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
  function pct(x) { return (100 * x).toFixed(1) + "%"; }
  function fixed(x, d) { return x === null || x === undefined ? "–" : Number(x).toFixed(d); }
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    var units = ["B", "KB", "MB", "GB", "TB"], i = 0, v = Number(n);
    while (v >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
  }
  function time(iso) { return iso ? iso.replace("T", " ").replace(/\.\d+/, "").replace(/(\+00:00|Z)$/, "") : "–"; }
  function merge(a, b) { var o = {}, k; for (k in a) o[k] = a[k]; for (k in b) o[k] = b[k]; return o; }
  function setText(id, text) { $(id).textContent = text; }

  // One chart: draws ``traces``, or shows ``emptyText`` in words instead of an empty plot.
  function chart(id, traces, layout, emptyText) {
    var el = $(id), empty = $(id + "-empty");
    if (!traces) {
      if (el.data) Plotly.purge(el);
      el.hidden = true;
      empty.textContent = emptyText;
      empty.hidden = false;
      return;
    }
    empty.hidden = true;
    el.hidden = false;
    var base = merge(BASE, el.classList.contains("short") ? { height: 190 } : {});
    Plotly.react(el, traces, merge(base, layout || {}), CONFIG);
  }

  function banner(text, kind) {
    var b = $("banner");
    b.textContent = text || "";
    b.className = "banner " + (kind || "");
    b.hidden = !text;
  }

  function kpis(d) {
    var s = d.stats, q = d.queue.counts;
    var total = 0, k;
    for (k in q) total += q[k];
    setText("kpi-documents", num(q.done));
    setText("kpi-documents-note",
      "done of " + num(total) + " · " + num(q.pending) + " pending · " + num(q.failed) + " failed");
    if (!s) {
      ["kpi-memrate", "kpi-entries", "kpi-bytes", "kpi-index"].forEach(function (id) { setText(id, "–"); });
      return;
    }
    setText("kpi-memrate", s.tokens_seen ? pct(s.memrate) : "–");
    setText("kpi-memrate-note", s.tokens_seen
      ? num(s.tokens_stored) + " of " + num(s.tokens_seen) + " tokens (FullMem: 100%)"
      : "nothing ingested yet");
    setText("kpi-entries", num(s.entries));
    setText("kpi-entries-note", num(s.datastore_entries) + " in the datastore · " +
      num(s.entries_forgotten) + " forgotten");
    setText("kpi-bytes", bytes(s.bytes_on_disk));
    setText("kpi-bytes-note", bytes(s.bytes_in_ram) + " in RAM · " + bytes(s.bytes_reclaimed) + " reclaimed by compaction");
    setText("kpi-index", s.index.served_version === null ? "none" : "v" + s.index.served_version);
    setText("kpi-index-note", s.index.version === null
      ? "no build yet: searches the exact index of new entries"
      : "built " + time(s.index.built_at) + " · " + num(s.index.entries) + " entries");
    var h = d.heldout.days, last = h.length ? h[h.length - 1] : null;
    setText("kpi-heldout", last ? fixed(last.lm_ppl, 1) + " → " + fixed(last.augmented_ppl, 1) : "–");
    setText("kpi-heldout-note", last ? fixed(100 * (last.augmented_ppl / last.lm_ppl - 1), 1) +
      "% with the memory · stream day " + last.day + ", " + num(last.tokens) + " tokens"
      : "no held-out tokens yet");
  }

  function memrate(d) {
    var days = d.days;
    if (!days.length) return chart("chart-memrate", null, null,
      "Nothing ingested yet: MemRate appears once the worker has memorised a document.");
    var x = days.map(function (p) { return p.day; });
    var text = days.map(function (p) {
      return num(p.tokens_stored) + " of " + num(p.tokens_seen) + " tokens, " + num(p.documents) + " documents";
    });
    chart("chart-memrate", [
      { type: "bar", name: "MemRate of the day", x: x, y: days.map(function (p) { return 100 * p.memrate; }),
        marker: { color: COLORS.day }, text: text, hovertemplate: "%{y:.1f}% (%{text})<extra></extra>",
        textposition: "none" },
      { type: "scatter", mode: "lines+markers", name: "cumulative", x: x,
        y: days.map(function (p) { return 100 * p.cumulative_memrate; }), line: { color: COLORS.cumulative, width: 3 },
        hovertemplate: "%{y:.1f}%<extra>cumulative</extra>" },
      { type: "scatter", mode: "lines", name: "FullMem (100%)", x: x, y: x.map(function () { return 100; }),
        line: { color: COLORS.fullmem, dash: "dash" }, hoverinfo: "skip" },
    ], { yaxis: { title: { text: "tokens memorised" }, ticksuffix: "%", range: [0, 105] },
      xaxis: DAY_AXIS, bargap: 0.25 });
  }

  function heldout(d) {
    var h = d.heldout, it = h.interpolation;
    var cap = "Perplexity of the held-out tokens the worker records, per stream day: the LM alone " +
      "against the LM with the memory served when each document arrived";
    if (it) {
      cap += it.lambda_source === "calibrator"
        ? " (lambda per token from the served calibrator, k " + it.k + ", T " + it.temperature + ")."
        : it.lambda_source === "evidence"
        ? " (lambda per token from the retrieval evidence, k " + it.k + ", T " + it.temperature + ")."
        : " (served interpolation: k " + it.k + ", T " + it.temperature + ", lambda " + it.lambda + ").";
    } else cap += ".";
    cap += " Dashed: the same tokens asked again once their document joined the memory (text it knows).";
    setText("heldout-caption", cap);
    if (!h.days.length) return chart("chart-heldout", null, null, "No held-out perplexity yet: " + (h.note || "nothing recorded") + ".");
    var x = h.days.map(function (p) { return p.day; });
    // per cent change of the perplexity with the memory, rounded as shown (no "-0.0%")
    var change = h.days.map(function (p) { return Math.round(1000 * (p.augmented_ppl / p.lm_ppl - 1)) / 10; });
    var all = h.days.map(function (p) { return p.lm_ppl; }).concat(h.days.map(function (p) { return p.augmented_ppl; }));
    var lo = Math.min.apply(null, all), hi = Math.max.apply(null, all), pad = 0.15 * Math.max(hi - lo, 0.05 * hi);
    var tokens = h.days.map(function (p) { return num(p.tokens) + " tokens, " + num(p.tokens_with_neighbours) + " with a neighbour"; });
    var traces = [
      { type: "scatter", mode: "lines+markers", name: "LM only", x: x, y: h.days.map(function (p) { return p.lm_ppl; }),
        line: { color: COLORS.lm, width: 2 }, text: tokens, hovertemplate: "%{y:.2f} (%{text})<extra>LM only</extra>" },
      { type: "scatter", mode: "lines+markers+text", name: "LM + memory (change)", x: x,
        y: h.days.map(function (p) { return p.augmented_ppl; }), line: { color: COLORS.aug, width: 3 },
        text: change.map(function (c) {
          return (c > 0 ? "+" : c < 0 ? "−" : "±") + Math.abs(c).toFixed(1) + "%";
        }),
        textposition: change.map(function (c) { return c > 0 ? "top center" : "bottom center"; }),
        textfont: { color: COLORS.aug },
        hovertemplate: "%{y:.2f} (%{text})<extra>LM + memory</extra>" },
    ];
    var known = h.days.filter(function (p) { return p.seen_tokens > 0; });
    if (known.length) {
      traces.push({ type: "scatter", mode: "lines+markers", name: "LM + memory, text it holds", x: known.map(function (p) { return p.day; }),
        y: known.map(function (p) { return p.seen_augmented_ppl; }), line: { color: COLORS.aug, width: 2, dash: "dash" },
        text: known.map(function (p) { return num(p.seen_tokens) + " tokens, LM only " + fixed(p.seen_lm_ppl, 1); }),
        hovertemplate: "%{y:.2f} (%{text})<extra>text the memory holds</extra>" });
    }
    // text the memory holds is far below the rest: a log axis keeps both readable
    var yaxis = known.length ? { title: { text: "perplexity (log)" }, type: "log" }
      : { title: { text: "perplexity" }, range: [lo - pad, hi + pad] };
    chart("chart-heldout", traces, { yaxis: yaxis, xaxis: DAY_AXIS,
      margin: { l: 60, r: 60, t: 24, b: 36 }, legend: { orientation: "h", x: 0, y: 1.2 } });
  }

  function memory(d) {
    var m = d.memory, days = d.days;
    var any = days.length || m.some(function (p) { return p.entries > 0; });
    if (!any) {
      chart("chart-memory", null, null, "The memory is empty: no entry stored yet.");
      return chart("chart-entries", null, null, "No stream day memorised yet.");
    }
    var x = m.map(function (p) { return p.at; });
    var labels = m.map(function (p) { return p.label; });
    var traces = [
      { type: "scatter", mode: "lines+markers", name: "live entries", x: x, y: m.map(function (p) { return p.entries; }),
        text: labels, line: { color: COLORS.entries, width: 3 }, hovertemplate: "%{y:,} entries (%{text})<extra></extra>" },
    ];
    var disk = m.map(function (p) { return p.bytes_on_disk; }), ram = m.map(function (p) { return p.bytes_in_ram; });
    if (disk.some(function (v) { return v !== null; })) {
      traces.push({ type: "scatter", mode: "lines+markers", name: "bytes on disk", x: x, y: disk, yaxis: "y2",
        line: { color: COLORS.disk, dash: "dot" }, connectgaps: true, hovertemplate: "%{y:.3s}B on disk<extra></extra>" });
    }
    if (ram.some(function (v) { return v !== null; })) {
      traces.push({ type: "scatter", mode: "lines+markers", name: "bytes in RAM", x: x, y: ram, yaxis: "y2",
        line: { color: COLORS.ram, dash: "dot" }, connectgaps: true, hovertemplate: "%{y:.3s}B in RAM<extra></extra>" });
    }
    chart("chart-memory", traces, {
      yaxis: { title: { text: "entries" }, rangemode: "tozero" },
      yaxis2: { title: { text: "bytes" }, overlaying: "y", side: "right", rangemode: "tozero", tickformat: ".2s", ticksuffix: "B", showgrid: false },
      xaxis: { type: "date" },
    });
    if (!days.length) return chart("chart-entries", null, null, "No stream day memorised yet.");
    chart("chart-entries", [
      { type: "scatter", mode: "lines+markers", name: "live entries", x: days.map(function (p) { return p.day; }),
        y: days.map(function (p) { return p.cumulative_entries; }), fill: "tozeroy",
        line: { color: COLORS.entries }, hovertemplate: "%{y:,} entries<extra></extra>" },
    ], { showlegend: false, yaxis: { rangemode: "tozero" }, xaxis: DAY_AXIS });
  }

  function throughput(d) {
    var t = d.throughput;
    if (!t.points.length) return chart("chart-throughput", null, null,
      "No document processed yet: the worker's speed appears with its first document.");
    setText("throughput-caption", "Tokens per second of ingest, the newest " + num(t.documents) +
      " documents in buckets of " + num(t.bucket_seconds) + " s (each document's tokens spread over its " +
      "claim-to-done time): one worker's speed while it works, and all workers' output per second.");
    var x = t.points.map(function (p) { return p.start; });
    chart("chart-throughput", [
      { type: "bar", name: "output (tokens / s of the bucket)", x: x, y: t.points.map(function (p) { return p.throughput; }),
        marker: { color: COLORS.throughput }, hovertemplate: "%{y:,.1f} tokens/s<extra>output</extra>" },
      { type: "scatter", mode: "lines+markers", name: "tokens/s while processing", x: x,
        y: t.points.map(function (p) { return p.tokens_per_s; }), line: { color: COLORS.speed, width: 3 },
        hovertemplate: "%{y:,.1f} tokens/s<extra>while processing</extra>" },
    ], { yaxis: { title: { text: "tokens / s" }, rangemode: "tozero" }, xaxis: { type: "date" } });
  }

  function queue(d) {
    var c = d.queue.counts, total = 0;
    var names = STATUSES.filter(function (n) { return n in c; })
      .concat(Object.keys(c).filter(function (n) { return STATUSES.indexOf(n) < 0; }));
    names.forEach(function (n) { total += c[n]; });
    setText("queue-caption", "Documents by status now" +
      (d.queue.waiting_retry ? " (" + num(d.queue.waiting_retry) + " pending ones wait to be retried)." : "."));
    if (!total) chart("chart-queue", null, null, "No document yet: POST /ingest queues documents here.");
    else chart("chart-queue", [
      { type: "bar", orientation: "h", y: names, x: names.map(function (n) { return c[n]; }),
        marker: { color: names.map(function (n) { return STATUS_COLORS[n] || "#888"; }) },
        text: names.map(function (n) { return num(c[n]); }), textposition: "outside", cliponaxis: false,
        hovertemplate: "%{y}: %{x:,}<extra></extra>" },
    ], { showlegend: false, hovermode: "closest", margin: { l: 90, r: 50, t: 8, b: 30 },
      yaxis: { autorange: "reversed" }, xaxis: { rangemode: "tozero" } });
    var f = d.failed, table = $("failed-table"), body = table.tBodies[0];
    body.replaceChildren();
    if (!f.total) {
      table.hidden = true;
      $("failed-empty").textContent = "No failed documents.";
      $("failed-empty").hidden = false;
      return;
    }
    $("failed-empty").hidden = !(f.total > f.documents.length);
    $("failed-empty").textContent = "The newest " + f.documents.length + " of " + num(f.total) + " failures.";
    f.documents.forEach(function (doc) {
      row(body, [doc.id, doc.source + (doc.external_id ? " / " + doc.external_id : ""), doc.title,
        doc.published_at, doc.attempts, doc.error || "", time(doc.failed_at)]);
    });
    table.hidden = false;
  }

  function row(body, cells) {
    var tr = document.createElement("tr");
    cells.forEach(function (v) {
      var td = document.createElement("td");
      td.textContent = v === null || v === undefined ? "–" : String(v);
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }

  // what the budget retires first; spread keeps the newest share of the budget whole
  // (none: every day thinned alike)
  function criterion(c) {
    if (c.recent === null || c.recent === undefined) return c.criterion;
    return c.criterion + (c.recent > 0 ? ", the newest " + Math.round(100 * c.recent) + "% whole"
      : ", every day alike");
  }

  // what a build's consolidation retired: re-tested entries that would not be stored
  // today, and entries retired to keep the memory budget
  function retired(c) {
    if (!c) return "–";
    var r = c.retired || {};
    return num(r.test || 0) + " / " + num(r.budget || 0) + (c.budget !== null && c.budget !== undefined
      ? " (budget " + num(c.budget) + ", " + criterion(c) + ")" : "") + ", " + num(c.examined) + " re-tested";
  }

  function builds(d) {
    var b = d.builds, done = b.filter(function (r) { return r.status === "done"; }).slice().reverse();
    var table = $("builds-table"), body = table.tBodies[0];
    body.replaceChildren();
    if (!b.length) {
      table.hidden = true;
      return chart("chart-builds", null, null,
        "No index built yet: the nightly rebuild (or POST /admin/rebuild) builds one; until then new entries are searched exactly.");
    }
    if (!done.length) chart("chart-builds", null, null, "No build has finished yet.");
    else chart("chart-builds", [
      { type: "bar", name: "build seconds", x: done.map(function (r) { return "v" + r.version; }),
        y: done.map(function (r) { return r.seconds; }), marker: { color: COLORS.build },
        text: done.map(function (r) { return num(r.entries) + " entries"; }),
        hovertemplate: "%{x}: %{y:.2f} s, %{text}<extra></extra>", textposition: "none" },
    ], { showlegend: false, hovermode: "closest", yaxis: { title: { text: "seconds" }, rangemode: "tozero" },
      xaxis: { type: "category" } });
    b.forEach(function (r) {
      var it = r.interpolation, sizes = r.sizes || {};
      var ev = it && it.evidence;
      var interp = it ? (it.lambda_source === "calibrator" ? "calibrator"
        : it.lambda_source === "evidence" && ev ? "evidence (" + (ev.source || "prior") + "), k " + ev.k + ", T " + ev.temperature
        : "k " + it.k + ", T " + it.temperature + ", λ " + it.lambda + " (" + it.source + ")") : "–";
      var ppl = it && it.bare_ppl !== null && it.ppl !== null ? fixed(it.bare_ppl, 2) + " → " + fixed(it.ppl, 2) : "–";
      row(body, [r.version === null ? "–" : "v" + r.version, r.status + (r.error ? ": " + r.error : ""), r.requested_by,
        time(r.finished_at), fixed(r.seconds, 2), num(r.entries), bytes(sizes.bytes_on_disk), interp, ppl,
        r.calibrator || "–", retired(r.consolidation)]);
    });
    table.hidden = false;
  }

  function calibrator(d) {
    var dl = $("calibrator"), s = d.stats;
    dl.replaceChildren();
    if (!s || !s.interpolation) {
      $("calibrator-empty").textContent = s ? "This engine reports no interpolation or calibrator."
        : "The model is not loaded yet.";
      $("calibrator-empty").hidden = false;
      return;
    }
    $("calibrator-empty").hidden = true;
    var it = s.interpolation, c = s.calibrator || {};
    function fact(k, v) {
      var dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = k;
      dd.textContent = v;
      dl.appendChild(dt);
      dl.appendChild(dd);
    }
    var cons = s.consolidation;
    if (cons) {
      fact("memory budget", (cons.budget === null ? "none" : num(cons.budget) + " entries, retiring by " + criterion(cons)) +
        "; " + num(cons.sample) + " entries re-tested a build" +
        (cons.last ? "; last build retired " + num(cons.last.retired.test) + " (would not be stored today) and " +
          num(cons.last.retired.budget) + " (budget)" : ""));
    }
    fact("lambda set by", it.lambda_source === "calibrator" ? "the calibrator (it beat the evidence)"
      : it.lambda_source === "evidence" ? "the retrieval evidence, per token" : "the constant (MEMLM_KNN_LAMBDA)");
    var ev = it.evidence;
    if (ev) {
      fact("evidence", (ev.source === "fitted" ? "fitted on " + num(ev.fitted_tokens) + " recorded tokens (held out and seen)" : "the prior") +
        ": bias " + fixed(ev.bias, 2) + ", distance " + fixed(ev.w_dist, 2) + ", agreement " + fixed(ev.w_agree, 2) +
        ", short context " + fixed(ev.w_short, 2));
    }
    fact("constant", "k " + it.k + ", T " + it.temperature + ", λ " + it.lambda + " (" + it.source +
      (it.chosen_for ? ", chosen at v" + it.chosen_for : ", no build chose yet") + ")");
    fact("held-out ppl at that choice", it.heldout_tokens
      ? fixed(it.heldout_bare_ppl, 2) + " LM only → " + fixed(it.heldout_ppl, 2) + " with the constant (" + num(it.heldout_tokens) + " tokens)"
      : "no held-out tokens yet");
    fact("calibrator", c.index_version
      ? (c.active ? "serving" : "trained, not serving") + ": v" + c.index_version + " (trained for v" + c.trained_for + "), " +
        num(c.train_tokens) + " training / " + num(c.val_tokens) + " validation tokens"
      : "none trained yet");
    fact("validation ppl, calibrator vs constant", it.calibrator_val_ppl !== null
      ? fixed(it.calibrator_val_ppl, 2) + " vs " + fixed(it.constant_val_ppl, 2) : "–");
    fact("retrieval gate", c.gate ? "on, θ " + c.gate_theta : "off");
    fact("training at each rebuild", c.training ? "on: " + num(c.pending_tokens) + " held-out tokens wait for the next build" : "off");
  }

  function render(d) {
    var s = d.stats;
    setText("subtitle", s
      ? "policy " + s.policy.policy + (s.policy.delta !== null ? " (δ " + s.policy.delta + ")" : "") + " · index " +
        (s.index.served_version === null ? "none" : "v" + s.index.served_version) + " · refreshes every " + d.refresh_seconds + " s"
      : "model " + d.model);
    if (d.model !== "ready") banner((d.model === "failed" ? "The model failed to load (see the server log)"
      : "The model is still loading") + ": figures from the engine appear once it is ready.", "warn");
    else if (!d.days.length && !d.queue.counts.pending && !d.queue.counts.processing)
      banner("Nothing ingested yet. POST documents to /ingest (ingest token); the charts fill in as the worker memorises them.", "info");
    else banner("");
    kpis(d);
    memrate(d);
    heldout(d);
    memory(d);
    throughput(d);
    queue(d);
    calibrator(d);
    builds(d);
    setText("updated", "updated " + time(d.generated_at) + " UTC");
    document.body.dataset.generatedAt = d.generated_at;
  }

  var last = null;
  function poll() {
    var wait = (last ? last.refresh_seconds : 10) * 1000;
    fetch("/admin/stats/history", { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } })
      .then(function (r) {
        if (r.status === 401) {
          banner("Your session has ended: reload the page to log in again.", "warn");
          return null;
        }
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      })
      .then(function (d) {
        if (!d) return;
        last = d;
        render(d);
        setTimeout(poll, d.refresh_seconds * 1000);
      })
      .catch(function (e) {
        banner("Could not refresh (" + e.message + "); showing the figures of " + (last ? time(last.generated_at) : "–") +
          " UTC. Retrying.", "warn");
        setTimeout(poll, wait);
      });
  }

  function start() {
    last = JSON.parse($("dashboard-data").textContent);
    render(last);
    setTimeout(poll, last.refresh_seconds * 1000);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
