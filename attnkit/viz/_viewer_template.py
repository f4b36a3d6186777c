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
      <p class="hint">Rows: queries; columns: keys; mean of the selected heads. Hover a cell.</p>
      <canvas id="matrix" width="10" height="10"></canvas>
    </section>
    <section id="view-model">
      <p class="hint">Every layer (rows) and head (columns); click one to open it in the head view.</p>
      <div id="grid"></div>
    </section>
  </div>
  <aside><h2 id="info-title">Hover a token</h2><ol id="info-list"></ol></aside>
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

  const state = { layer: 0, heads: [0], view: 'head', hover: null, drawn: [] };
  window.attnkit = { state, row, tokens: T };

  function sync() {
    document.body.dataset.layer = String(state.layer);
    document.body.dataset.heads = state.heads.join(',');
    document.body.dataset.view = state.view;
    document.body.dataset.hover = state.hover ? state.hover.side + ':' + state.hover.i : '';
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
  $('matrix').addEventListener('mousemove', (ev) => {
    if (!matrixGeom) return;
    const g = matrixGeom, rect = $('matrix').getBoundingClientRect();
    const a = Math.floor((ev.clientY - rect.top - g.pad) / g.cell), b = Math.floor((ev.clientX - rect.left - g.pad) / g.cell);
    if (a < 0 || b < 0 || a >= g.s || b >= g.s) return;
    const q = Math.floor(a * L / g.s), k = Math.floor(b * L / g.s);
    info('Layer ' + state.layer + ', heads ' + state.heads.join(','), [[T[q], ' \u2192 ', T[k], ' ' + g.m[a * g.s + b].toFixed(3) + (g.s < L ? ' (max of a block)' : ''), { q, k }]]);
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
    sync();
  }
  render();
  document.body.dataset.ready = '1';
})();
</script>
</body>
</html>
"""
