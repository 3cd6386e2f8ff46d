// EdgeFleet console: charts, actions and live updates through the fleet API (/api/v1).
// Every string that came from a device is set with textContent, never as HTML.
"use strict";
(function () {
  const csrf = (document.querySelector('meta[name="csrf"]') || {}).content || "";

  async function api(method, path, body) {
    const init = { method, headers: { "X-CSRF-Token": csrf }, credentials: "same-origin" };
    if (body instanceof FormData) init.body = body;
    const r = await fetch("/api/v1" + path, init);
    const data = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error((data.error || r.statusText) + (data.where ? " (" + data.where + ")" : ""));
    return data;
  }

  // --- charts --------------------------------------------------------------------------
  const RANGES = { "15m": 900, "1h": 3600, "6h": 21600, "24h": 86400, "7d": 604800 };
  const charts = document.getElementById("charts");
  const plots = [];

  async function draw(range) {
    if (!charts) return;
    const device = charts.dataset.device;
    const until = Date.now() / 1000;
    const since = until - RANGES[range];
    for (const fig of charts.querySelectorAll(".chart")) {
      const signal = fig.dataset.signal;
      const q = new URLSearchParams({ signal, since: String(since), until: String(until), points: "400" });
      const s = await api("GET", "/devices/" + encodeURIComponent(device) + "/telemetry?" + q);
      const xs = s.points.map((p) => p.t_ns / 1e9);
      const data = [xs, s.points.map((p) => p.min), s.points.map((p) => p.mean), s.points.map((p) => p.max)];
      const box = fig.querySelector(".plot");
      box.replaceChildren();
      const opts = {
        width: Math.max(300, box.clientWidth || 320), height: 180,
        series: [{}, { label: "min", stroke: "#98a2b3" }, { label: "mean", stroke: "#2e90fa", width: 2 },
                 { label: "max", stroke: "#98a2b3" }],
        bands: [{ series: [3, 1], fill: "rgba(46,144,250,0.08)" }],
        axes: [{}, { size: 60 }],
      };
      const plot = new uPlot(opts, data, box);
      plot.edgefleet = { signal, points: xs.length };
      plots.push(plot);
      fig.dataset.points = String(xs.length);
    }
  }
  window.edgefleetPlots = plots;
  if (charts) {
    draw("1h");
    for (const b of document.querySelectorAll("#ranges button")) {
      b.addEventListener("click", () => {
        for (const o of document.querySelectorAll("#ranges button")) o.classList.toggle("on", o === b);
        plots.splice(0, plots.length);
        draw(b.dataset.range);
      });
    }
  }

  // --- rollout page: actions and live state ----------------------------------------------
  const section = document.getElementById("rollout");
  function bar(cls, n, total) {
    const s = document.createElement("span");
    s.className = cls;
    s.style.width = total ? (100 * n / total).toFixed(1) + "%" : "0%";
    return s;
  }
  // One refresh at a time; an event during one asks for one more after it. Overlapping
  // GETs can answer out of order, and the page would keep the older state until the next
  // event, which may never come (the rollout finished).
  let refreshing = null;
  let again = false;
  function refreshRollout() {
    if (refreshing) {
      again = true;
      return refreshing;
    }
    refreshing = (async () => {
      do {
        again = false;
        await renderRollout();
      } while (again);
    })().finally(() => { refreshing = null; });
    return refreshing;
  }
  async function renderRollout() {
    const r = await api("GET", "/rollouts/" + encodeURIComponent(section.dataset.rollout));
    const state = document.getElementById("rollout-state");
    state.textContent = r.state;
    state.className = "state-" + r.state;
    const waves = document.getElementById("waves");
    waves.replaceChildren(...r.waves.map((w) => {
      const c = w.states;
      const row = document.createElement("div");
      row.className = "wave";
      row.dataset.wave = String(w.wave);
      const label = document.createElement("span");
      label.className = "label";
      label.textContent = "wave " + w.wave + " · " + w.devices + " device(s)";
      const b = document.createElement("span");
      b.className = "bar";
      b.append(bar("committed", c.committed || 0, w.devices),
               bar("flight", (c.offered || 0) + (c.in_progress || 0), w.devices),
               bar("failed", (c.failed || 0) + (c.rolled_back || 0) + (c.timed_out || 0), w.devices));
      const counts = document.createElement("span");
      counts.className = "counts";
      counts.textContent = (c.committed || 0) + "/" + w.devices + " committed";
      row.append(label, b, counts);
      return row;
    }));
    for (const tr of document.querySelectorAll("#rollout-devices tbody tr")) {
      const d = r.devices[tr.dataset.device];
      if (!d) continue;
      tr.children[2].textContent = d.state;
      tr.children[2].className = "state-" + d.state;
      tr.children[3].textContent = String(d.attempts);
      tr.children[4].textContent = (d.code + " " + d.reason).trim();
    }
    const history = document.getElementById("history");
    history.replaceChildren(...r.history.slice(-20).reverse().map((h) => {
      const li = document.createElement("li");
      li.textContent = h.event;
      return li;
    }));
  }
  for (const b of document.querySelectorAll("#actions button")) {
    b.addEventListener("click", async () => {
      const action = b.dataset.action;
      const rid = document.getElementById("actions").dataset.rollout;
      if (!window.confirm(action[0].toUpperCase() + action.slice(1) + " rollout " + rid + "?")) return;
      const out = document.getElementById("action-result");
      try {
        await api("POST", "/rollouts/" + encodeURIComponent(rid) + "/" + action);
        out.textContent = action + " requested";
      } catch (e) {
        out.textContent = e.message;
      }
    });
  }

  // --- rollout creation with a dry-run preview ------------------------------------------
  const create = document.getElementById("create");
  if (create) {
    const plan = document.getElementById("plan");
    const start = document.getElementById("start");
    async function send(dry) {
      const form = new FormData(create);
      form.set("dry_run", dry ? "true" : "false");
      try {
        const r = await api("POST", "/rollouts", form);
        if (dry) {
          plan.textContent = r.plan.map((w, i) => "wave " + (i + 1) + ": " + w.length + " device(s): " + w.join(", ")).join("\n");
          start.disabled = false;
        } else {
          window.location.href = "/rollouts/" + encodeURIComponent(r.id);
        }
      } catch (e) {
        plan.textContent = e.message;
        start.disabled = true;
      }
    }
    document.getElementById("preview").addEventListener("click", () => send(true));
    start.addEventListener("click", () => { if (window.confirm("Start this rollout?")) send(false); });
  }

  // --- live events ------------------------------------------------------------------------
  if (document.getElementById("who") && window.EventSource) {
    const events = new EventSource("/api/v1/events");
    const online = (e, up) => {
      const d = JSON.parse(e.data).device;
      for (const cell of document.querySelectorAll(".state[data-device], tr[data-device] .state")) {
        const owner = cell.dataset.device || cell.closest("tr").dataset.device;
        if (owner !== d) continue;
        cell.textContent = up ? "online" : "offline";
        cell.classList.toggle("on", up);
        cell.classList.toggle("off", !up);
      }
    };
    events.addEventListener("device.online", (e) => online(e, true));
    events.addEventListener("device.offline", (e) => online(e, false));
    const onRollout = (e) => {
      if (section && JSON.parse(e.data).rollout === section.dataset.rollout) refreshRollout();
    };
    events.addEventListener("rollout.state", onRollout);
    events.addEventListener("rollout.device", onRollout);
    events.addEventListener("resync", () => { if (section) refreshRollout(); });
  }
})();
