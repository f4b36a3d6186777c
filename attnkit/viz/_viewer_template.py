# ruff: noqa: E501 - the page is HTML/CSS/JS in a string; its lines are not Python lines.
"""The viewer page: HTML, CSS and JavaScript in one string, with no external resource of any kind.

``viewer.py`` fills two placeholders, in one pass over this template (a title or token holding a
placeholder's name is never taken for one): the escaped page title, and the JSON data block (with
``<``, ``>`` and ``&`` written as ``\\u003c``-style escapes so no token can close the script element).
The script only ever puts token strings into the page through ``textContent`` or canvas
``fillText``, never through ``innerHTML``.
"""

TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__ATTNKIT_TITLE__</title>
<style>
  :root { --ink: #1d2433; --muted: #6b7280; --line: #e5e7eb; --accent: #1f5fbf; --row: 20px; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--ink); background: #fff; }
  header { padding: 12px 18px 6px; border-bottom: 1px solid var(--line); }
  h1 { font-size: 18px; margin: 0 0 2px; }
  #summary, #note { color: var(--muted); font-size: 12px; margin: 0; }
  nav { display: flex; flex-wrap: wrap; gap: 10px 18px; align-items: center; padding: 8px 18px; border-bottom: 1px solid var(--line); }
  nav .group { display: flex; flex-wrap: wrap; gap: 4px; align-items: center; }
  nav .label { color: var(--muted); font-size: 12px; margin-right: 4px; }
  select, button { font: inherit; font-size: 13px; }
  button { border: 1px solid #cbd5e1; background: #f8fafc; border-radius: 4px; padding: 2px 8px; cursor: pointer; }
  button.on { background: var(--accent); color: #fff; border-color: var(--accent); }
  .chip { display: inline-flex; align-items: center; gap: 3px; padding: 1px 5px; border: 1px solid #cbd5e1; border-radius: 10px; cursor: pointer; font-size: 12px; user-select: none; }
  .chip input { margin: 0; }
  .sw { width: 10px; height: 10px; border-radius: 2px; display: inline-block; }
  main { display: flex; gap: 18px; padding: 12px 18px; align-items: flex-start; }
  section { display: none; }
  section.active { display: block; }
  #head-wrap { display: flex; align-items: flex-start; }
  .col { display: flex; flex-direction: column; }
  .tok { height: var(--row); line-height: var(--row); padding: 0 6px; white-space: pre; font: 13px ui-monospace, "DejaVu Sans Mono", monospace; cursor: default; border-radius: 3px; max-width: 16em; overflow: hidden; text-overflow: ellipsis; }
  #left .tok { text-align: right; }
  .tok.hover { outline: 2px solid var(--accent); }
  #lines { display: block; }
  #matrix { border: 1px solid var(--line); image-rendering: pixelated; }
  #grid { display: grid; gap: 6px; }
  .thumb { display: flex; flex-direction: column; align-items: center; font-size: 10px; color: var(--muted); cursor: pointer; }
  .thumb canvas { border: 1px solid var(--line); width: 64px; height: 64px; image-rendering: pixelated; }
  .thumb.sel canvas { border-color: var(--accent); outline: 2px solid var(--accent); }
  aside { min-width: 260px; max-width: 360px; font-size: 13px; position: sticky; top: 8px; }
  aside h2 { font-size: 14px; margin: 0 0 6px; }
  #info-list { padding-left: 0; list-style: none; margin: 0; }
  #info-list li { margin: 3px 0; }
  .k { font-family: ui-monospace, "DejaVu Sans Mono", monospace; background: #eef2ff; border-radius: 3px; padding: 0 3px; white-space: pre; }
  .w { color: var(--muted); }
  .hint { color: var(--muted); font-size: 12px; }
  #terms { margin-top: 14px; padding-top: 8px; border-top: 1px solid var(--line); }
  #terms p { margin: 4px 0; }
  #terms-top { padding-left: 0; list-style: none; margin: 4px 0; font: 12px ui-monospace, "DejaVu Sans Mono", monospace; }
  #terms-chart { display: block; margin: 6px 0; }
  #terms-chart text { font: 10px ui-monospace, "DejaVu Sans Mono", monospace; fill: var(--ink); }
  .up { color: #b2182b; }
  .down { color: #2166ac; }
</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <p id="summary"></p>
  <p id="note"></p>
</header>
<nav>
  <div class="group"><span class="label">Layer</span><select id="layer" aria-label="layer"></select></div>
  <div class="group" id="heads"><span class="label">Heads</span></div>
  <div class="group"><button id="all-heads" type="button">all</button><button id="no-heads" type="button">none</button></div>
  <div class="group" id="views"><span class="label">View</span>
    <button type="button" data-view="head">head view</button>
    <button type="button" data-view="matrix">matrix</button>
    <button type="button" data-view="model">all layers &times; heads</button>
  </div>
</nav>
<main>
  <div>
    <section id="view-head">
      <p class="hint">Left: tokens attending (queries); right: tokens attended to (keys). Line opacity is the weight; hover a token.</p>
      <div id="head-wrap"><div class="col" id="left"></div><canvas id="lines" width="240" height="20"></canvas><div class="col" id="right"></div></div>
    </section>
    <section id="view-matrix">
      <p class="hint">Rows: queries; columns: keys; mean of the selected heads. Hover a cell; click one to take its score apart by dimension.</p>
      <canvas id="matrix" width="10" height="10"></canvas>
    </section>
    <section id="view-model">
      <p class="hint">Every layer (rows) and head (columns); click one to open it in the head view.</p>
      <div id="grid"></div>
    </section>
  </div>
  <aside><h2 id="info-title">Hover a token</h2><ol id="info-list"></ol>
    <div id="terms" hidden>
      <h2 id="terms-title"></h2>
      <div class="group"><span class="label">Head</span> <select id="terms-head" aria-label="head of the score terms"></select></div>
      <p id="terms-sum"></p>
      <p id="terms-weight"></p>
      <svg id="terms-chart" width="340" height="170" role="img" aria-label="the score's terms per dimension, largest first"></svg>
      <ol id="terms-top"></ol>
      <p class="hint" id="terms-hint"></p>
    </div>
  </aside>
</main>
<script id="attnkit-data" type="application/json">__ATTNKIT_DATA__</script>
<script>
(function () {
  'use strict';
  const D = JSON.parse(document.getElementById('attnkit-data').textContent);
  const T = D.tokens, L = T.length, NL = D.layers, NH = D.heads, K = D.top_k;
  const LONG = 128, ROW = L > 256 ? 14 : 20, MAX_CELLS = 512, THUMB = 64;
  const COLORS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f',
                  '#bcbd22', '#17becf', '#393b79', '#ad494a', '#637939', '#8c6d31', '#7b4173', '#3182bd'];
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; };
  function bytes(s) { const b = atob(s); const a = new Uint8Array(b.length); for (let i = 0; i < b.length; i++) a[i] = b.charCodeAt(i); return a; }
  const W = D.mode === 'dense' ? bytes(D.weights) : null;
  const IDX = D.mode === 'topk' ? new Uint16Array(bytes(D.indices).buffer) : null;
  const VAL = D.mode === 'topk' ? bytes(D.values) : null;
  // Score terms (when the page has q and k): q [NL, NH, L, dim], k [NL, kv_heads, L, dim] as float32,
  // each row's log-sum-exp over the keys it may attend, and a bit per cell whose weight is exactly 0.
  const TR = D.terms;
  const TQ = TR ? new Float32Array(bytes(TR.q).buffer) : null, TK = TR ? new Float32Array(bytes(TR.k).buffer) : null;
  const LSE = TR ? new Float64Array(bytes(TR.lse).buffer) : null, MASKED = TR && TR.masked ? bytes(TR.masked) : null;
  const TOP_TERMS = 5;

  // One query row of one head, as floats in [0, 1] (weights are stored as 8-bit levels).
  function row(l, h, q) {
    const out = new Float32Array(L);
    if (W) { const o = ((l * NH + h) * L + q) * L; for (let k = 0; k < L; k++) out[k] = W[o + k] / 255; }
    else { const o = ((l * NH + h) * L + q) * K; for (let t = 0; t < K; t++) out[IDX[o + t]] = VAL[o + t] / 255; }
    return out;
  }
  function meanMatrix(l, heads) {
    const m = new Float32Array(L * L);
    for (const h of heads) for (let q = 0; q < L; q++) { const r = row(l, h, q); for (let k = 0; k < L; k++) m[q * L + k] += r[k] / heads.length; }
    return m;
  }
  function topOf(r, n) { return Array.from(r, (w, k) => [k, w]).filter((e) => e[1] > 0).sort((a, b) => b[1] - a[1]).slice(0, n); }
  function color(w) {  // white to dark blue
    const t = Math.max(0, Math.min(1, w));
    return [Math.round(255 - t * 247), Math.round(255 - t * 207), Math.round(255 - t * 148)];
  }

  const state = { layer: 0, heads: [0], view: 'head', hover: null, drawn: [], cell: null, termsHead: 0 };
  window.attnkit = { state, row, tokens: T };

  function sync() {
    document.body.dataset.layer = String(state.layer);
    document.body.dataset.heads = state.heads.join(',');
    document.body.dataset.view = state.view;
    document.body.dataset.hover = state.hover ? state.hover.side + ':' + state.hover.i : '';
    document.body.dataset.cell = state.cell ? state.cell.q + ':' + state.cell.k : '';
  }

  // ---- header and controls
  $('title').textContent = D.title;
  $('summary').textContent = L + ' tokens \u00b7 ' + NL + ' layers \u00d7 ' + NH + ' heads' + (D.text ? ' \u00b7 \u201c' + D.text + '\u201d' : '');
  $('note').textContent = D.note || '';
  for (let l = 0; l < NL; l++) { const o = el('option', '', 'layer ' + l); o.value = String(l); $('layer').appendChild(o); }
  $('layer').addEventListener('change', () => { state.layer = Number($('layer').value); render(); });
  for (let h = 0; h < NH; h++) {
    const lab = el('label', 'chip'); const box = el('input'); box.type = 'checkbox'; box.id = 'head-' + h; box.dataset.head = String(h);
    const sw = el('span', 'sw'); sw.style.background = COLORS[h % COLORS.length];
    lab.append(box, sw, document.createTextNode(String(h)));
    box.addEventListener('change', () => { setHeads(Array.from(document.querySelectorAll('#heads input:checked'), (b) => Number(b.dataset.head))); });
    $('heads').appendChild(lab);
  }
  function setHeads(hs) { state.heads = hs.slice().sort((a, b) => a - b); render(); }
  $('all-heads').addEventListener('click', () => setHeads(Array.from({ length: NH }, (_, h) => h)));
  $('no-heads').addEventListener('click', () => setHeads([]));
  for (const b of document.querySelectorAll('#views button')) b.addEventListener('click', () => { state.view = b.dataset.view; render(); });

  // ---- head view
  function tokenColumn(id, side) {
    const col = $(id);
    T.forEach((t, i) => {
      const d = el('div', 'tok', t); d.dataset.i = String(i); d.title = i + ': ' + t; d.style.height = ROW + 'px'; d.style.lineHeight = ROW + 'px';
      d.addEventListener('mouseenter', () => { state.hover = { side, i }; render(); });
      d.addEventListener('mouseleave', () => { state.hover = null; render(); });
      col.appendChild(d);
    });
  }
  tokenColumn('left', 'q'); tokenColumn('right', 'k');

  function drawHead() {
    const c = $('lines'), ctx = c.getContext('2d');
    c.height = L * ROW; c.style.height = c.height + 'px';
    ctx.clearRect(0, 0, c.width, c.height);
    state.drawn = [];
    const hv = state.hover, links = [];
    for (const h of state.heads) {
      for (let q = 0; q < L; q++) {
        if (hv && hv.side === 'q' && hv.i !== q) continue;
        const r = row(state.layer, h, q);
        // Beyond LONG tokens, only each query's 3 strongest links are drawn until a token is hovered.
        const entries = (L > LONG && !hv) ? topOf(r, 3) : Array.from(r, (w, k) => [k, w]);
        for (const [k, w] of entries) {
          if (w < 0.01 || (hv && hv.side === 'k' && hv.i !== k)) continue;
          links.push([h, q, k, w]);
        }
      }
    }
    ctx.lineWidth = 2;
    for (const [h, q, k, w] of links) {
      ctx.globalAlpha = Math.min(1, w); ctx.strokeStyle = COLORS[h % COLORS.length];
      ctx.beginPath(); ctx.moveTo(2, q * ROW + ROW / 2); ctx.lineTo(c.width - 2, k * ROW + ROW / 2); ctx.stroke();
      state.drawn.push({ head: h, q, k, w });
    }
    ctx.globalAlpha = 1;
    // Shade the other column by the mean weight over the selected heads.
    const left = $('left').children, right = $('right').children;
    for (const d of left) { d.style.background = ''; d.classList.remove('hover'); }
    for (const d of right) { d.style.background = ''; d.classList.remove('hover'); }
    if (hv && state.heads.length) {
      const col = hv.side === 'q' ? right : left;
      (hv.side === 'q' ? left : right)[hv.i].classList.add('hover');
      const acc = new Float32Array(L);
      for (const h of state.heads) {
        if (hv.side === 'q') { const r = row(state.layer, h, hv.i); for (let j = 0; j < L; j++) acc[j] += r[j] / state.heads.length; }
        else for (let j = 0; j < L; j++) acc[j] += row(state.layer, h, j)[hv.i] / state.heads.length;
      }
      for (let j = 0; j < L; j++) if (acc[j] > 0.005) { const [r, g, b] = color(acc[j]); col[j].style.background = 'rgba(' + r + ',' + g + ',' + b + ',0.9)'; col[j].style.color = acc[j] > 0.6 ? '#fff' : ''; }
    }
  }

  // ---- matrix view (max-pooled to at most MAX_CELLS cells a side)
  function pooled(m, n) {
    const s = Math.min(L, n), out = new Float32Array(s * s);
    for (let q = 0; q < L; q++) { const a = Math.floor(q * s / L); for (let k = 0; k < L; k++) { const b = Math.floor(k * s / L), v = m[q * L + k]; if (v > out[a * s + b]) out[a * s + b] = v; } }
    return [out, s];
  }
  let matrixGeom = null;
  function drawMatrix() {
    const c = $('matrix'), ctx = c.getContext('2d');
    if (!state.heads.length) { c.width = c.height = 10; matrixGeom = null; return; }
    const [m, s] = pooled(meanMatrix(state.layer, state.heads), MAX_CELLS);
    let vmax = 1e-6; for (const v of m) if (v > vmax) vmax = v;
    const cell = Math.max(1, Math.floor(560 / s)), pad = (L <= 64 && cell >= 8) ? 90 : 0;
    c.width = c.height = pad + s * cell;
    ctx.fillStyle = '#fff'; ctx.fillRect(0, 0, c.width, c.height);
    const img = ctx.createImageData(s * cell, s * cell);
    for (let a = 0; a < s; a++) for (let b = 0; b < s; b++) {
      const [r, g, bl] = color(m[a * s + b] / vmax);
      for (let y = 0; y < cell; y++) for (let x = 0; x < cell; x++) { const p = ((a * cell + y) * s * cell + b * cell + x) * 4; img.data[p] = r; img.data[p + 1] = g; img.data[p + 2] = bl; img.data[p + 3] = 255; }
    }
    ctx.putImageData(img, pad, pad);
    if (state.cell) {  // the cell whose score terms the panel shows
      const a = Math.floor(state.cell.q * s / L), b = Math.floor(state.cell.k * s / L);
      ctx.strokeStyle = '#f59e0b'; ctx.lineWidth = 2;
      ctx.strokeRect(pad + b * cell + 1, pad + a * cell + 1, Math.max(1, cell - 2), Math.max(1, cell - 2));
    }
    if (pad) {
      ctx.fillStyle = '#1d2433'; ctx.font = Math.min(12, cell - 1) + 'px monospace'; ctx.textBaseline = 'middle';
      T.forEach((t, i) => {
        const lab = t.length > 11 ? t.slice(0, 10) + '\u2026' : t;
        ctx.textAlign = 'right'; ctx.fillText(lab, pad - 4, pad + i * cell + cell / 2);
        ctx.save(); ctx.translate(pad + i * cell + cell / 2, pad - 4); ctx.rotate(-Math.PI / 2); ctx.textAlign = 'left'; ctx.fillText(lab, 0, 0); ctx.restore();
      });
    }
    matrixGeom = { pad, cell, s, m };
  }
  // The cell under the mouse: pooled cell (a, b) and the first query and key of its block.
  function cellAt(ev) {
    if (!matrixGeom) return null;
    const g = matrixGeom, rect = $('matrix').getBoundingClientRect();
    const a = Math.floor((ev.clientY - rect.top - g.pad) / g.cell), b = Math.floor((ev.clientX - rect.left - g.pad) / g.cell);
    if (a < 0 || b < 0 || a >= g.s || b >= g.s) return null;
    return { a, b, q: Math.floor(a * L / g.s), k: Math.floor(b * L / g.s) };
  }
  $('matrix').addEventListener('mousemove', (ev) => {
    const c = cellAt(ev), g = matrixGeom;
    if (!c) return;
    info('Layer ' + state.layer + ', heads ' + state.heads.join(','), [[T[c.q], ' \u2192 ', T[c.k], ' ' + g.m[c.a * g.s + c.b].toFixed(3) + (g.s < L ? ' (max of a block)' : ''), { q: c.q, k: c.k }]]);
  });
  $('matrix').addEventListener('click', (ev) => {
    const c = cellAt(ev);
    if (!c) return;
    state.cell = { q: c.q, k: c.k };
    if (!state.heads.includes(state.termsHead)) state.termsHead = state.heads[0];
    render();
  });

  // ---- all layers x heads
  let gridBuilt = false;
  function buildGrid() {
    const grid = $('grid'); grid.style.gridTemplateColumns = 'repeat(' + NH + ', 70px)';
    for (let l = 0; l < NL; l++) for (let h = 0; h < NH; h++) {
      const box = el('div', 'thumb'); box.dataset.layer = String(l); box.dataset.head = String(h);
      const c = el('canvas'); const [m, s] = pooled(meanMatrix(l, [h]), THUMB); c.width = c.height = s;
      let vmax = 1e-6; for (const v of m) if (v > vmax) vmax = v;
      const ctx = c.getContext('2d'), img = ctx.createImageData(s, s);
      for (let i = 0; i < s * s; i++) { const [r, g, b] = color(m[i] / vmax); img.data.set([r, g, b, 255], i * 4); }
      ctx.putImageData(img, 0, 0);
      box.append(c, el('span', '', 'L' + l + ' H' + h));
      box.addEventListener('click', () => { state.layer = l; state.heads = [h]; state.view = 'head'; render(); });
      grid.appendChild(box);
    }
    gridBuilt = true;
  }

  // ---- side panel
  function info(title, items) {
    $('info-title').textContent = title;
    const list = $('info-list'); list.textContent = '';
    for (const it of items) {
      const li = el('li');
      it.slice(0, -1).forEach((part, j) => li.appendChild(j === 0 ? el('b', '', part) : el('span', part.startsWith(' ') ? 'w' : 'k', part)));
      Object.assign(li.dataset, Object.fromEntries(Object.entries(it[it.length - 1]).map(([a, b]) => [a, String(b)])));
      list.appendChild(li);
    }
  }
  function hoverInfo() {
    const hv = state.hover;
    if (!hv) { info('Hover a token', []); return; }
    const items = [];
    for (const h of state.heads) {
      if (hv.side === 'q') {
        const top = topOf(row(state.layer, h, hv.i), 4), li = ['head ' + h + ':'];
        for (const [k, w] of top) li.push(' ', T[k], ' ' + w.toFixed(2));
        li.push({ head: h, topKey: top.length ? top[0][0] : -1, topWeight: top.length ? top[0][1].toFixed(3) : 0 });
        items.push(li);
      } else {
        const col = Float32Array.from({ length: L }, (_, q) => row(state.layer, h, q)[hv.i]);
        const top = topOf(col, 4), li = ['head ' + h + ':'];
        for (const [q, w] of top) li.push(' ', T[q], ' ' + w.toFixed(2));
        li.push({ head: h, topQuery: top.length ? top[0][0] : -1 });
        items.push(li);
      }
    }
    const who = T[hv.i];
    info((hv.side === 'q' ? 'What \u201c' + who + '\u201d attends to' : 'What attends to \u201c' + who + '\u201d') + ' (layer ' + state.layer + ')', items);
  }

  // ---- score terms of the clicked cell: score = sum over d of q[i, d] * k[j, d] * scale
  const SVG = $('terms-chart').namespaceURI;  // the page's own inline <svg> carries the SVG namespace
  function svgEl(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [a, v] of Object.entries(attrs)) e.setAttribute(a, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  }
  const signed = (x, p) => (x > 0 ? '+' : '') + x.toPrecision(p);
  for (let h = 0; h < NH; h++) { const o = el('option', '', 'head ' + h); o.value = String(h); $('terms-head').appendChild(o); }
  $('terms-head').addEventListener('change', () => { state.termsHead = Number($('terms-head').value); render(); });
  function scoreTerms(l, h, i, j) {  // [dim] terms, in float64 from the stored float32 q and k
    const d = TR.dim, hk = Math.floor(h / (NH / TR.kv_heads)), s = TR.scale[l];
    const qo = ((l * NH + h) * L + i) * d, ko = ((l * TR.kv_heads + hk) * L + j) * d;
    return Array.from({ length: d }, (_, x) => TQ[qo + x] * TK[ko + x] * s);
  }
  function drawTerms(terms) {  // bars sorted by magnitude, the largest few labelled along the top
    const svg = $('terms-chart'), W = 340, H = 170, TOP = 34, BOT = 6, d = terms.length;
    svg.textContent = '';
    const order = terms.map((t, x) => [x, t]).sort((u, v) => Math.abs(v[1]) - Math.abs(u[1]) || u[0] - v[0]);
    let hi = 0, lo = 0;
    for (const t of terms) { if (t > hi) hi = t; if (t < lo) lo = t; }
    const unit = (H - TOP - BOT) / ((hi - lo) || 1), y0 = TOP + hi * unit, slot = (W - 8) / d, bw = Math.max(1, slot * 0.8);
    const top = (t) => (t >= 0 ? y0 - t * unit : y0);
    order.forEach(([x, t], r) => {
      const bar = svgEl('rect', { x: 4 + r * slot, y: top(t), width: bw, height: Math.max(0.5, Math.abs(t) * unit), fill: t >= 0 ? '#b2182b' : '#2166ac' });
      bar.dataset.dim = String(x); bar.dataset.term = String(t);
      bar.appendChild(svgEl('title', {}, 'd' + x + ': ' + signed(t, 4)));
      svg.appendChild(bar);
    });
    svg.appendChild(svgEl('line', { x1: 2, x2: W - 2, y1: y0, y2: y0, stroke: '#9ca3af', 'stroke-width': 1 }));
    const n = Math.min(TOP_TERMS, d), lw = (W - 8) / n;
    for (let r = 0; r < n; r++) {
      const [x, t] = order[r], lx = 4 + (r + 0.5) * lw;
      const lab = svgEl('text', { x: lx, y: 11, 'text-anchor': 'middle' }, 'd' + x);
      lab.dataset.dim = String(x);
      svg.append(lab, svgEl('text', { x: lx, y: 23, 'text-anchor': 'middle' }, signed(t, 3)));
      svg.appendChild(svgEl('line', { x1: lx, y1: 26, x2: 4 + r * slot + bw / 2, y2: top(t), stroke: '#6b7280', 'stroke-width': 0.6 }));
    }
  }
  function showTerms() {
    const box = $('terms'), c = state.cell;
    box.hidden = !c;
    if (!c) return;
    const l = state.layer, h = state.termsHead;
    $('terms-head').value = String(h);
    $('terms-title').textContent = '';
    $('terms-title').append(document.createTextNode('Score of '), el('span', 'k', T[c.q]), document.createTextNode(' \u2192 '),
                            el('span', 'k', T[c.k]), document.createTextNode(' (layer ' + l + ', query ' + c.q + ', key ' + c.k + ')'));
    Object.assign(box.dataset, { layer: String(l), head: String(h), query: String(c.q), key: String(c.k) });
    for (const id of ['terms-sum', 'terms-weight', 'terms-top', 'terms-chart', 'terms-hint']) $(id).textContent = '';
    if (!TR) {
      $('terms-sum').textContent = D.terms_note || 'This page holds the attention weights only: write it with qk= (the queries and keys, recorded with attnkit.analysis.record.recorded_qk) to take a score apart by dimension.';
      return;
    }
    const terms = scoreTerms(l, h, c.q, c.k), d = terms.length;
    let score = 0;
    for (const t of terms) score += t;
    const order = terms.map((t, x) => [x, t]).sort((u, v) => Math.abs(v[1]) - Math.abs(u[1]) || u[0] - v[0]);
    const n = Math.min(TOP_TERMS, d);
    let topSum = 0;
    for (let r = 0; r < n; r++) topSum += order[r][1];
    box.dataset.score = String(score);
    $('terms-sum').append(document.createTextNode('score = q\u00b7k \u00d7 scale = sum of the ' + d + ' terms = '), el('b', '', score.toFixed(4)),
                          el('span', 'w', ' (largest ' + n + ': ' + signed(topSum, 4) + (d > n ? ', the other ' + (d - n) + ': ' + signed(score - topSum, 4) : '') + ')'));
    const cellIdx = ((l * NH + h) * L + c.q) * L + c.k, shown = row(l, h, c.q)[c.k];
    let weight, say;
    if (MASKED && (MASKED[cellIdx >> 3] >> (7 - (cellIdx & 7))) & 1) {
      weight = 0; say = 'weight 0: this key is masked for this query, so its score is not used';
    } else if (TR.softmax[l][h]) {
      weight = Math.exp(score - LSE[(l * NH + h) * L + c.q]);
      say = 'weight = softmax of the row\u2019s scores = ' + weight.toFixed(4) + ' (this head\u2019s map: ' + shown.toFixed(3) + ')';
    } else {
      weight = shown;
      say = 'weight in the map = ' + shown.toFixed(3) + '; this head\u2019s weights are not the softmax of q\u00b7k \u00d7 scale alone (a position bias, a bias or a score_mod adds to its scores, or they were computed in lower precision)';
    }
    box.dataset.weight = String(weight);
    box.dataset.softmax = TR.softmax[l][h] ? '1' : '0';
    $('terms-weight').textContent = say;
    drawTerms(terms);
    const qo = ((l * NH + h) * L + c.q) * d, ko = ((l * TR.kv_heads + Math.floor(h / (NH / TR.kv_heads))) * L + c.k) * d;
    for (let r = 0; r < n; r++) {
      const [x, t] = order[r], li = el('li');
      li.append(el('b', '', 'd' + x), document.createTextNode(': q ' + TQ[qo + x].toPrecision(4) + ' \u00d7 k ' + TK[ko + x].toPrecision(4) + ' \u00d7 ' + TR.scale[l].toPrecision(4) + ' = '),
                el('span', t >= 0 ? 'up' : 'down', signed(t, 4)));
      li.dataset.dim = String(x); li.dataset.term = String(t);
      $('terms-top').appendChild(li);
    }
    $('terms-hint').textContent = 'Bars: the ' + d + ' terms q[i,d] \u00d7 k[j,d] \u00d7 scale, largest first; red raises the score, blue lowers it.';
  }

  function render() {
    $('layer').value = String(state.layer);
    for (const b of document.querySelectorAll('#heads input')) b.checked = state.heads.includes(Number(b.dataset.head));
    for (const b of document.querySelectorAll('#views button')) b.classList.toggle('on', b.dataset.view === state.view);
    for (const v of ['head', 'matrix', 'model']) $('view-' + v).classList.toggle('active', v === state.view);
    if (state.view === 'head') { drawHead(); hoverInfo(); }
    if (state.view === 'matrix') drawMatrix();
    if (state.view === 'model') {
      if (!gridBuilt) buildGrid();
      for (const t of document.querySelectorAll('.thumb')) t.classList.toggle('sel', Number(t.dataset.layer) === state.layer && state.heads.includes(Number(t.dataset.head)));
    }
    showTerms();
    sync();
  }
  render();
  document.body.dataset.ready = '1';
})();
</script>
</body>
</html>
"""
