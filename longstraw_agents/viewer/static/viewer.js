// longstraw view: runs, metrics and groups of a trajectory store; a group drawn as the prefix tree the trainer
// trains on. No dependencies and no network but the page's own server (served mode): everything else is inline.
(() => {
  'use strict';
  const boot = JSON.parse(document.getElementById('longstraw-data').textContent);
  const served = boot.mode === 'served';
  const index = boot.index;
  const ROLES = ['system', 'user', 'assistant', 'tool'];
  const COLLAPSED_PIECE_TOKENS = 160; // longer pieces (long tool outputs) start collapsed, their length shown
  const OPEN_BRANCH_TOKENS = 600; // a branch up to this long starts open
  const OPEN_MEMBER_ROWS = 8; // a group of more members starts with its table closed
  const state = {
    run: '', env: '', step: null, vmin: null, vmax: null, rmin: null, rmax: null, mixed: false,
    selected: null, group: null, focus: null, shadeLoss: true, shadeLogprob: true,
  };

  // ---- helpers --------------------------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === 'class') node.className = value;
      else if (key === 'text') node.textContent = value;
      else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? '' : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const $ = (selector) => document.querySelector(selector);
  const count = (n) => Number(n).toLocaleString('en-US');
  function num(value, digits = 3) {
    if (value === null || value === undefined) return '—';
    return Number(value).toFixed(digits);
  }
  function signed(value) {
    if (value === null || value === undefined) return '—';
    return (value > 0 ? '+' : value < 0 ? '−' : '') + Math.abs(value).toFixed(3);
  }
  const advClass = (value) => (value > 0 ? 'adv-pos' : value < 0 ? 'adv-neg' : '');
  const groupName = (entry) => entry.group_id || `episode ${entry.key}`;
  const shortEnv = (envIds) => envIds.map((id) => id.replace(/^LongStraw\//, '')).join(', ');

  // ---- data -----------------------------------------------------------------------------------------------------
  async function fetchJson(url) {
    const response = await fetch(url);
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || `${url}: HTTP ${response.status}`);
    return body;
  }
  async function loadGroup(key) {
    if (!served) {
      const group = boot.groups[String(key)];
      if (!group) throw new Error(`group ${key} is not embedded in this page`);
      return group;
    }
    return fetchJson(`api/group/${key}`);
  }
  const loadTokens = (key, member, start, end) =>
    fetchJson(`api/tokens/${key}?member=${member}&start=${start}&end=${end}`);

  // ---- header, runs, filters ------------------------------------------------------------------------------------
  function renderHeader() {
    $('#source').textContent = index.store + (index.selection ? `  where ${index.selection}` : '');
    $('#mode').textContent = served ? 'served: groups and token ranges load on demand' : 'self-contained page';
    if (boot.note) $('#embedded-note').append(el('p', { class: 'note', text: boot.note }));
  }

  function renderRuns() {
    const box = $('#runs');
    box.replaceChildren();
    for (const run of index.runs) {
      box.append(el('div', {
        class: 'run' + (state.run === run.id ? ' selected' : ''), 'data-run': run.id,
        onclick: () => { state.run = state.run === run.id ? '' : run.id; $('#f-run').value = state.run; refresh(); },
      },
      el('span', { class: 'mono', text: run.id }), ' ',
      el('span', { class: 'meta', text: [run.model, run.tokenizer, run.groups ? `${count(run.groups)} groups` : null,
        run.alone ? `${count(run.alone)} episodes played alone` : null, run.has_metrics ? 'metrics' : null].filter(Boolean).join(' · ') }),
      run.notes ? el('div', { class: 'meta', text: run.notes }) : null));
    }
    if (!index.runs.length) box.append(el('p', { class: 'note', text: 'no runs recorded in this store' }));
  }

  function fillSelect(select, values) {
    for (const value of values) select.append(el('option', { value, text: value }));
  }

  function bindFilters() {
    fillSelect($('#f-run'), index.runs.map((run) => run.id));
    fillSelect($('#f-env'), [...new Set(index.groups.flatMap((g) => g.env_ids))].sort());
    const numeric = (id, key) => $(id).addEventListener('input', (event) => {
      const text = event.target.value.trim();
      state[key] = text === '' ? null : Number(text);
      refresh();
    });
    numeric('#f-step', 'step'); numeric('#f-vmin', 'vmin'); numeric('#f-vmax', 'vmax');
    numeric('#f-rmin', 'rmin'); numeric('#f-rmax', 'rmax');
    $('#f-run').addEventListener('change', (event) => { state.run = event.target.value; refresh(); });
    $('#f-env').addEventListener('change', (event) => { state.env = event.target.value; refresh(); });
    $('#f-mixed').addEventListener('change', (event) => { state.mixed = event.target.checked; refresh(); });
  }

  function matches(entry) {
    if (state.run && entry.run_id !== state.run) return false;
    if (state.env && !entry.env_ids.includes(state.env)) return false;
    if (state.step !== null && entry.step !== state.step) return false;
    if (state.vmin !== null && entry.max_version < state.vmin) return false;
    if (state.vmax !== null && entry.min_version > state.vmax) return false;
    if (state.rmin !== null && (entry.reward_max === null || entry.reward_max < state.rmin)) return false;
    if (state.rmax !== null && (entry.reward_min === null || entry.reward_min > state.rmax)) return false;
    if (state.mixed && !(entry.reward_min !== null && entry.reward_min !== entry.reward_max)) return false;
    return true;
  }

  function renderGroupList() {
    const body = $('#groups tbody');
    body.replaceChildren();
    const shown = index.groups.filter(matches);
    for (const entry of shown) {
      const reward = entry.reward_mean === null ? '—'
        : `${num(entry.reward_mean, 2)} [${num(entry.reward_min, 2)}, ${num(entry.reward_max, 2)}]`;
      const versions = entry.min_version === entry.max_version ? entry.min_version : `${entry.min_version}–${entry.max_version}`;
      body.append(el('tr', {
        class: state.selected === entry.key ? 'selected' : null, 'data-key': entry.key,
        onclick: () => selectGroup(entry.key),
      },
      el('td', { class: 'mono', text: groupName(entry) }), el('td', { text: entry.step ?? '' }),
      el('td', { text: shortEnv(entry.env_ids) }), el('td', { text: entry.members }),
      el('td', { text: reward }), el('td', { text: count(entry.tokens) }), el('td', { text: versions })));
    }
    $('#group-count').textContent = `(${count(shown.length)} of ${count(index.groups.length)})`;
    if (!shown.length && state.step !== null) {
      const hint = served ? 'no group of this step in the selection'
        : `no group of step ${state.step} in this page: longstraw view ${index.store} --where "group_id LIKE 'step${state.step}-%'"`;
      body.append(el('tr', {}, el('td', { colspan: 7, class: 'note', text: hint })));
    }
  }

  // ---- metrics charts -------------------------------------------------------------------------------------------
  const CHARTS = [
    { key: 'reward_mean', label: 'reward (mean)', color: '#059669', evals: true },
    { key: 'loss', label: 'GRPO loss', color: '#2563eb' },
    { key: 'kl', label: 'KL', color: '#b45309' },
  ];

  function renderCharts() {
    const box = $('#charts');
    box.replaceChildren();
    const metrics = index.metrics;
    if (!metrics || !metrics.steps.length) {
      box.append(el('p', { class: 'note', text: metrics ? `${metrics.path} has no GRPO steps` : 'no metrics.jsonl beside this store' }));
      return;
    }
    box.append(el('p', { class: 'note', text: `${metrics.path} (run ${metrics.run_id ?? '—'})` }));
    for (const chart of CHARTS) {
      const points = metrics.steps.filter((s) => typeof s[chart.key] === 'number').map((s) => [s.step, s[chart.key]]);
      const evals = chart.evals ? metrics.evals.map((e) => [e.step, e.reward_mean]) : [];
      if (points.length) box.append(drawChart(chart, points, evals, metrics.steps));
    }
  }

  function drawChart(chart, points, evals, steps) {
    const W = 330, H = 84, L = 40, R = 8, T = 14, B = 16;
    const all = points.concat(evals);
    const xs = steps.map((s) => s.step).concat(evals.map((e) => e[0]));
    const x0 = Math.min(...xs), x1 = Math.max(...xs);
    let y0 = Math.min(...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
    if (y0 === y1) { y0 -= 1; y1 += 1; }
    const sx = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const NS = 'http://www.w3.org/2000/svg';
    const svg = document.createElementNS(NS, 'svg');
    const add = (tag, attrs, text) => {
      const node = document.createElementNS(NS, tag);
      for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
      if (text !== undefined) node.textContent = text;
      svg.append(node);
      return node;
    };
    svg.setAttribute('class', 'chart');
    svg.setAttribute('width', W);
    svg.setAttribute('height', H);
    svg.dataset.metric = chart.key;
    add('text', { x: L, y: 10 }, chart.label);
    add('text', { x: 2, y: T + 8 }, y1.toPrecision(3));
    add('text', { x: 2, y: H - B }, y0.toPrecision(3));
    add('text', { x: L, y: H - 3 }, `step ${x0}`);
    add('text', { x: W - R, y: H - 3, 'text-anchor': 'end' }, `${x1}`);
    add('polyline', { class: 'curve', stroke: chart.color, points: points.map(([x, y]) => `${sx(x)},${sy(y)}`).join(' ') });
    for (const [x, y] of evals) add('rect', { x: sx(x) - 3, y: sy(y) - 3, width: 6, height: 6, fill: '#111827' }).append(tooltip(`held-out reward at step ${x}: ${num(y)}`));
    if (state.step !== null) add('line', { class: 'mark', x1: sx(state.step), x2: sx(state.step), y1: T, y2: H - B });
    const current = state.group && index.groups.find((g) => g.key === state.group.key);
    if (current && current.step !== null) add('line', { class: 'here', x1: sx(current.step), x2: sx(current.step), y1: T, y2: H - B });
    for (const [x, y] of points) {
      const dot = add('circle', { class: 'pt', cx: sx(x), cy: sy(y), r: 2.5, fill: chart.color, 'data-step': x });
      dot.append(tooltip(`step ${x}: ${chart.label} ${num(y, 4)}`));
    }
    svg.addEventListener('click', (event) => {
      const box = svg.getBoundingClientRect();
      const at = x0 + ((event.clientX - box.left - L) / (W - L - R)) * (x1 - x0);
      const nearest = points.reduce((best, p) => (Math.abs(p[0] - at) < Math.abs(best[0] - at) ? p : best), points[0]);
      setStep(state.step === nearest[0] ? null : nearest[0]);
    });
    function tooltip(text) {
      const title = document.createElementNS(NS, 'title');
      title.textContent = text;
      return title;
    }
    return svg;
  }

  function setStep(step) {
    state.step = step;
    $('#f-step').value = step === null ? '' : step;
    refresh();
  }

  function refresh() {
    renderRuns();
    renderCharts();
    renderGroupList();
  }

  // ---- one group ------------------------------------------------------------------------------------------------
  async function selectGroup(key) {
    state.selected = key;
    state.focus = null;
    history.replaceState(null, '', `#group=${key}`);
    renderGroupList();
    const main = $('#main');
    main.replaceChildren(el('p', { class: 'hint', text: 'loading…' }));
    try {
      state.group = await loadGroup(key);
    } catch (err) {
      state.group = null;
      main.replaceChildren(el('p', { class: 'error', text: String(err.message || err) }));
      return;
    }
    renderGroup();
    renderCharts();
  }

  function renderGroup() {
    const g = state.group;
    const entry = index.groups.find((e) => e.key === g.key) || {};
    const main = $('#main');
    const head = el('div', { class: 'group-head' },
      el('h2', { text: `${g.group_id ? 'group ' + g.group_id : 'episode ' + g.key}` }),
      el('div', { class: 'facts' },
        el('span', { text: `run ${g.run_id ?? '—'}` }),
        el('span', { text: shortEnv(g.env_ids) }),
        entry.step !== null && entry.step !== undefined ? el('span', { text: `trained at step ${entry.step}` }) : null,
        el('span', { text: `${g.members.length} member${g.members.length === 1 ? '' : 's'}` }),
        el('span', { text: `${count(g.total_tokens)} tokens, ${count(g.unique_tokens)} in the tree` }),
        el('span', { text: g.text_source })),
      el('p', { class: 'note', text: g.advantage_note }));
    const controls = el('div', { class: 'controls' },
      el('label', {}, el('input', { type: 'checkbox', id: 'shade-loss', checked: state.shadeLoss, onchange: (e) => { state.shadeLoss = e.target.checked; applyShading(); } }), ' underline loss tokens'),
      el('label', {}, el('input', { type: 'checkbox', id: 'shade-lp', checked: state.shadeLogprob, onchange: (e) => { state.shadeLogprob = e.target.checked; applyShading(); } }), ' shade by behaviour logprob (darker: less likely)'),
      el('span', { class: 'legend' }, ROLES.map((role) => el('span', { class: `role-${role}`, style: `background: var(--${role}-bg); color: var(--${role})`, text: role }))),
      el('button', { onclick: () => setOpen(true) }, 'expand all'),
      el('button', { onclick: () => setOpen(false) }, 'collapse all'));
    const tree = el('div', { class: 'tree', id: 'tree' });
    if (g.tree_error) tree.append(el('p', { class: 'error', text: g.tree_error }));
    else if (g.branches.length) tree.append(renderBranch(g, g.branches[0]));
    main.replaceChildren(head, membersTable(g), controls, tree);
    applyShading();
    applyFocus();
  }

  // the versions that sampled a member's turns: one, or the range an episode spanned across weight updates
  function versionsText(m) {
    const versions = m.turn_versions.length ? m.turn_versions : [m.policy_version];
    const lo = Math.min(...versions), hi = Math.max(...versions);
    return lo === hi ? `${lo}` : `${lo}–${hi}`;
  }

  function membersTable(g) {
    const rows = g.members.map((m) => el('tr', {
      'data-member': m.index, onclick: () => toggleFocus(m.index),
    },
    el('td', { text: `#${m.index}` }), el('td', { text: m.episode }), el('td', { text: num(m.reward) }),
    el('td', { class: advClass(m.advantage), text: signed(m.advantage) }),
    el('td', {}, el('span', { class: 'finish ' + m.finish_reason, text: m.finish_reason })),
    el('td', { text: versionsText(m) }), el('td', { text: m.staleness ?? '—' }),
    el('td', { text: count(m.tokens) }), el('td', { text: count(m.loss_tokens) }),
    el('td', { text: m.has_logprobs ? 'yes' : 'no' }),
    el('td', { class: m.truncated_tool_outputs ? 'adv-neg' : '', text: m.truncated_tool_outputs })));
    const table = el('table', { class: 'members' },
      el('thead', {}, el('tr', {}, ['member', 'episode', 'reward', 'advantage', 'finish', 'version', 'stale', 'tokens', 'loss tokens', 'logprobs', 'truncated tool outputs'].map((h) => el('th', { text: h })))),
      el('tbody', {}, rows));
    // a large group's table starts closed: the tree's leaves show each member's reward and advantage too
    return el('details', { class: 'members-box', open: g.members.length <= OPEN_MEMBER_ROWS },
      el('summary', { text: `members (${g.members.length})` }), table);
  }

  function roleCounts(branch) {
    const counts = {};
    for (const piece of branch.pieces) counts[piece.role] = (counts[piece.role] || 0) + piece.end - piece.start;
    return counts;
  }

  function roleBar(branch) {
    const counts = roleCounts(branch);
    const total = branch.end - branch.start || 1;
    const bar = el('span', { class: 'rolebar', title: ROLES.filter((r) => counts[r]).map((r) => `${r} ${count(counts[r])}`).join(', ') });
    for (const role of ROLES) {
      if (counts[role]) bar.append(el('i', { style: `width: ${(100 * counts[role]) / total}%; background: var(--${role})` }));
    }
    return bar;
  }

  function branchLabel(g, branch) {
    if (branch.parent === null) {
      if (branch.end === branch.start) return 'no shared first token';
      return g.members.length > 1 ? 'shared prefix' : 'episode';
    }
    return branch.children.length || branch.members.length > 1 ? `branch ${branch.id}` : `member #${branch.members[0]}'s path`;
  }

  function renderBranch(g, branch) {
    const tokens = branch.end - branch.start;
    // an episode alone opens whole (its long pieces stay collapsed); a shared prefix starts closed
    const open = branch.parent === null ? g.members.length === 1 : tokens <= OPEN_BRANCH_TOKENS;
    const body = el('div', { class: 'branch-body', hidden: !open });
    let filled = false;
    const fill = () => {
      if (filled) return;
      filled = true;
      body.append(...branch.pieces.map((piece) => renderPiece(g, branch, piece)));
    };
    if (open) fill();
    const toggle = el('span', { class: 'toggle', text: open ? '▾' : '▸' });
    const chips = el('span', { class: 'chips' }, branch.members.map((m) => el('span', {
      class: 'chip', 'data-member': m, text: `#${m}`,
      onclick: (event) => { event.stopPropagation(); toggleFocus(m); },
    })));
    const head = el('div', {
      class: 'branch-head', onclick: () => {
        fill();
        body.hidden = !body.hidden;
        toggle.textContent = body.hidden ? '▸' : '▾';
      },
    }, toggle, el('span', { class: 'label', text: branchLabel(g, branch) }),
    el('span', { class: 'mono', text: `${count(tokens)} tokens [${count(branch.start)}, ${count(branch.end)})` }),
    roleBar(branch),
    branch.loss_tokens ? el('span', { text: `${count(branch.loss_tokens)} loss tokens` }) : el('span', { class: 'note', text: 'no loss' }),
    branch.advantage_sum !== null ? el('span', { class: advClass(branch.advantage_sum), title: 'Σ advantage of its members: what each of its loss tokens carries', text: `ΣA ${signed(branch.advantage_sum)}` }) : null,
    chips);
    const node = el('div', { class: 'branch', 'data-branch': branch.id, 'data-members': branch.members.join(' ') }, head, body);
    node.fillBody = fill;
    if (branch.ends.length) node.append(el('div', { class: 'ends' }, branch.ends.map((m) => leaf(g.members[m]))));
    if (branch.children.length > 1) {
      node.append(el('div', { class: 'fork', text: `◆ branch point after token ${count(branch.end)}: ${branch.children.length} continuations` }));
    }
    if (branch.children.length) {
      node.append(el('div', { class: 'children' }, branch.children.map((id) => renderBranch(g, g.branches[id]))));
    }
    return node;
  }

  function leaf(member) {
    return el('span', {
      class: 'leaf', 'data-member': member.index, onclick: () => toggleFocus(member.index),
    }, el('b', { text: `#${member.index}` }), ` episode ${member.episode} · reward ${num(member.reward)} · `,
    el('span', { class: advClass(member.advantage), text: `A ${signed(member.advantage)}` }), ' · ',
    el('span', { class: 'finish ' + member.finish_reason, text: member.finish_reason }), ` · ${count(member.tokens)} tokens`);
  }

  function renderPiece(g, branch, piece) {
    const length = piece.end - piece.start;
    const collapsed = length > COLLAPSED_PIECE_TOKENS;
    const calls = piece.tool_calls || [];
    const truncated = calls.filter((c) => c && c.truncated);
    const toggle = el('span', { class: 'toggle', text: collapsed ? '▸' : '▾' });
    const tokens = el('div', { class: 'tokens', hidden: collapsed, 'data-start': piece.start, 'data-end': piece.end });
    fillTokens(g, branch, piece, tokens);
    const what = piece.role === 'tool' ? 'tool output' : piece.role;
    const head = el('div', {
      class: 'piece-head', onclick: () => {
        tokens.hidden = !tokens.hidden;
        toggle.textContent = tokens.hidden ? '▸' : '▾';
      },
    }, toggle, el('span', { class: 'role', text: what }), ` · turn ${piece.turn} · segment ${piece.segment} · ${count(length)} tokens`,
    piece.loss_tokens ? ` · ${count(piece.loss_tokens)} loss` : '',
    piece.policy_version === null ? '' : ` · sampled by v${piece.policy_version}`
      + (piece.staleness === null ? '' : ` (${piece.staleness} stale)`),
    piece.segment_start ? null : el('span', { class: 'badge', text: 'continues' }),
    calls.length ? el('span', { class: 'badge', text: piece.role === 'tool' ? `${calls.length} result${calls.length > 1 ? 's' : ''}` : `${calls.length} tool call${calls.length > 1 ? 's' : ''}` }) : null,
    truncated.length ? el('span', { class: 'badge warn', text: `truncated (${truncated.map((c) => count(c.original_length ?? 0)).join(', ')} chars)` }) : null);
    const node = el('div', { class: `piece role-${piece.role}`, 'data-start': piece.start }, head, tokens);
    for (const call of calls) node.append(toolDetails(piece.role, call));
    return node;
  }

  function toolDetails(role, call) {
    const name = (call && call.name) || 'call';
    const summary = role === 'tool'
      ? `result of ${name}: ${call.ok === false ? 'error' : 'ok'}${call.truncated ? ', truncated' : ''}`
      : `tool call: ${name}`;
    return el('details', { class: 'tool' }, el('summary', { text: summary }), el('pre', { text: JSON.stringify(call, null, 2) }));
  }

  function fillTokens(g, branch, piece, box) {
    let at = piece.start;
    for (const window of piece.windows) {
      if (window.start > at) box.append(gap(g, branch, at, window.start));
      box.append(windowSpans(window));
      at = window.start + window.text.length;
    }
    if (at < piece.end) box.append(gap(g, branch, at, piece.end));
  }

  function windowSpans(window) {
    const frag = document.createDocumentFragment();
    window.text.forEach((text, i) => {
      const span = document.createElement('span');
      span.className = window.loss[i] === '1' ? 't loss' : 't';
      span.dataset.p = window.start + i;
      const lp = window.logprobs ? window.logprobs[i] : null;
      if (lp !== null) {
        span.dataset.lp = lp;
        const shade = lp === '-inf' ? 1 : Math.min(1, -Number(lp) / 5);
        span.style.setProperty('--lp', shade.toFixed(3));
      }
      span.textContent = text;
      frag.append(span);
    });
    return frag;
  }

  function gap(g, branch, start, end) {
    const hidden = end - start;
    if (!served) {
      return el('span', { class: 'gap', text: `… ${count(hidden)} tokens not in this page (longstraw view --serve shows them) …` });
    }
    const button = el('button', { class: 'gap', 'data-start': start, 'data-end': end, text: `… ${count(hidden)} tokens: load ${count(Math.min(hidden, g.range_tokens))} …` });
    button.addEventListener('click', async () => {
      button.disabled = true;
      try {
        const window = await loadTokens(g.key, branch.members[0], start, Math.min(end, start + g.range_tokens));
        const loadedEnd = window.start + window.text.length;
        button.before(windowSpans(window));
        if (loadedEnd < end) button.replaceWith(gap(g, branch, loadedEnd, end));
        else button.remove();
      } catch (err) {
        button.disabled = false;
        button.textContent = `could not load: ${err.message || err}`;
      }
    });
    return button;
  }

  function applyShading() {
    const tree = $('#tree');
    if (!tree) return;
    tree.classList.toggle('shade-loss', state.shadeLoss);
    tree.classList.toggle('shade-lp', state.shadeLogprob);
  }

  function toggleFocus(member) {
    state.focus = state.focus === member ? null : member;
    applyFocus();
  }

  function applyFocus() {
    const focus = state.focus;
    for (const node of document.querySelectorAll('#tree .branch')) {
      const on = focus !== null && node.dataset.members.split(' ').includes(String(focus));
      node.classList.toggle('on-path', on);
      node.classList.toggle('off-path', focus !== null && !on);
    }
    for (const node of document.querySelectorAll('#main [data-member]')) {
      node.classList.toggle('focus', focus !== null && node.dataset.member === String(focus));
    }
  }

  function setOpen(open) {
    for (const node of document.querySelectorAll('#tree .branch')) {
      if (open) node.fillBody();
      node.querySelector(':scope > .branch-body').hidden = !open;
      node.querySelector(':scope > .branch-head .toggle').textContent = open ? '▾' : '▸';
    }
  }

  // token details on hover, computed when needed (a long page holds many tokens)
  document.addEventListener('mouseover', (event) => {
    const span = event.target.closest && event.target.closest('.t');
    if (!span || span.title) return;
    const lp = span.dataset.lp;
    const parts = [`position ${span.dataset.p}`, span.classList.contains('loss') ? 'loss token' : 'no loss'];
    if (lp !== undefined) parts.push(lp === '-inf' ? 'behaviour logprob −inf' : `behaviour logprob ${Number(lp).toFixed(4)} (p ${Math.exp(Number(lp)).toFixed(3)})`);
    span.title = parts.join(' · ');
  });

  // ---- start ----------------------------------------------------------------------------------------------------
  renderHeader();
  bindFilters();
  refresh();
  const wanted = /#group=(\d+)/.exec(location.hash);
  const first = wanted ? Number(wanted[1]) : (index.groups.length === 1 ? index.groups[0].key : null);
  if (first !== null) selectGroup(first);
})();
