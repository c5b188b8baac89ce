/* The comparison page: one table per report, both traces aligned row by row.

   Rows are grid rows of fixed height rather than a <table>: a table lays out every row before it
   paints anything, while these rows are skipped until they scroll into view (content-visibility),
   so a model of thousands of ops opens as fast as a small one. Column widths come from the data.

   Each compared row has two error bars on a log axis: the max absolute difference against atol
   and the max relative difference against rtol, the tolerance marked. A row is within tolerance
   when |a - b| <= atol + rtol * |b| everywhere, so one bar past its mark does not make a row
   diverge; the verdict column is the report's own. The first divergence is highlighted and
   scrolled into view. Row keys are described in torchlens/view/report_page.py. */

const DECADES_BELOW = 8, DECADES_ABOVE = 4;  // the bars' axis, in powers of ten around the tolerance
const VERDICT_CLASS = {
  "within": "ok", "diverged": "bad", "not comparable": "bad", "unchecked": "muted",
  "only in a": "one", "only in b": "one",
};
const TABLES = DATA.tables;

function number(value) {
  if (value === undefined) return "-";
  if (typeof value === "string") return value;  // inf, -inf, nan: JSON has no such numbers
  if (value === 0) return "0";
  return value.toExponential(2).replace(/e([+-])(\d)$/, "e$10$2");
}

/* Where `value` sits on the bar, 0 to 1: zero is empty, infinite (or anything against an exact
   tolerance) is full, the rest is log-scaled with the tolerance DECADES_BELOW powers of ten in. */
function fraction(value, tolerance) {
  if (value === 0) return 0;
  if (typeof value === "string" || tolerance === 0) return 1;
  const decades = Math.log10(value / tolerance) + DECADES_BELOW;
  return Math.min(1, Math.max(0.02, decades / (DECADES_BELOW + DECADES_ABOVE)));
}

/* One difference against its tolerance: a bar (a single element drawn by CSS gradients from
   --fill, cheap enough for thousands of rows) and the number. */
function errorCell(value, tolerance, name, toleranceName) {
  if (value === undefined) return el("span", "cell", "-");
  const wrap = el("span", "cell err");
  const bar = el("span", tolerance > 0 ? "bar" : "bar exact");
  bar.style.setProperty("--fill", (fraction(value, tolerance) * 100).toFixed(1) + "%");
  bar.title = name + " " + number(value) + " against " + toleranceName + " " + number(tolerance) +
    (tolerance === 0 ? " (a tolerance of 0: any difference is out of it)" : "");
  wrap.appendChild(bar);
  wrap.appendChild(el("span", "num", number(value)));
  return wrap;
}

/* Module depth as narration counts it (module calls: a ModuleList is never called, a Sequential
   is), carried by each row. */
function depth(row) {
  return row.dp || 0;
}

/* The module path, with the part it shares with the row above faded: runs of one module read as a group. */
function moduleCell(path, previous) {
  const node = el("span", "cell mod");
  if (!path) {
    node.appendChild(el("span", previous === "" ? "same" : null, "(root)"));
    return node;
  }
  const parts = path.split("."), before = previous ? previous.split(".") : [];
  let shared = 0;
  while (shared < parts.length && parts[shared] === before[shared]) shared += 1;
  if (shared) {
    node.appendChild(el("span", "same", parts.slice(0, shared).join(".") + (shared < parts.length ? "." : "")));
  }
  if (shared < parts.length) node.appendChild(el("span", null, parts.slice(shared).join(".")));
  return node;
}

function cell(cls, text) {
  const node = el("span", "cell " + cls, text);
  if (text) node.title = text;  // a cell too narrow for its text shows the rest on hover
  return node;
}

function rowElement(row, tag, previous) {
  if (row.cut) {  // rows a notebook view left out: how many, in their place
    row.el = el("div", "crow cut", row.o);
    return row.el;
  }
  const line = el("div", "crow " + (VERDICT_CLASS[row.v] || ""));
  line.appendChild(cell("n", row.a === undefined ? "-" : tag + row.a));
  line.appendChild(cell("n", row.b === undefined ? "-" : tag + row.b));
  const op = cell("op", row.o);
  op.style.paddingLeft = (2 * depth(row)) + "ch";
  line.appendChild(op);
  const module = moduleCell(row.p || "", previous);
  module.title = row.p || "(root)";
  line.appendChild(module);
  line.appendChild(cell("verdict", row.v));
  line.appendChild(errorCell(row.d, row.at, "max abs diff", "atol"));
  line.appendChild(errorCell(row.r, row.rt, "max rel diff", "rtol"));
  line.appendChild(cell("why", row.j ? judgementText(row) : row.why));
  if (row.j === "real") line.classList.add("real");
  row.el = line;
  return line;
}

/* A judged row's note: rounding, real or carried, each side's ulps from float64, the nearer side,
   and for a real row the side whose own op is off, by how much on its own inputs. */
function judgementText(row) {
  if (row.j === "unjudged") return "unjudged: " + row.why;
  const ulps = function (value) { return value === undefined ? "-" : Number(value).toPrecision(3) + " ulps"; };
  let text = row.j + ": a " + ulps(row.ua) + ", b " + ulps(row.ub);
  if (row.j !== "real" && (row.oa !== undefined || row.ob !== undefined)) {
    text += " (each op's own: a " + ulps(row.oa) + ", b " + ulps(row.ob) + ")";
  }
  if (row.j === "real" && row.c) text += ", " + row.c + " nearer float64";
  if (row.j === "real" && row.f) {
    text += "; " + row.f + "'s op " + ulps(row.f === "a" ? row.oa : row.ob) + " off on its own inputs";
  }
  if (row.j === "carried") return text + ", carried in from a real op";
  return text + " (allowed " + ulps(row.al) + ")";
}

/* The op and module columns as wide as their longest entry (within reason), in characters. */
function columnWidths(box, rows) {
  let op = 4, module = 8;
  for (const row of rows) {
    if (row.cut) continue;
    op = Math.max(op, row.o.length + 2 * depth(row));
    module = Math.max(module, (row.p || "(root)").length);
  }
  box.style.setProperty("--op", Math.min(op, 40) + 1 + "ch");
  box.style.setProperty("--module", Math.min(module, 56) + 1 + "ch");
}

/* A leading line: a button to the row it names (index `at`), or plain text when it names none. */
function summaryLine(table, text, at) {
  const line = el("p", "summary " + (at === null ? "ok" : "bad"));
  if (at === null) line.textContent = text;
  else line.appendChild(button(text, function () { focusRow(table.rows[at]); }, "jump"));
  return line;
}

function tableElement(table) {
  const box = el("section", "table");
  box.appendChild(el("h2", null, table.title));
  if (table.verdict !== undefined) box.appendChild(summaryLine(table, table.verdict, table.real));
  box.appendChild(summaryLine(table, table.summary, table.first));
  box.appendChild(el("p", "tally", table.tally + "."));
  box.appendChild(el("p", "tally", "Bars: log scale, from " + DECADES_BELOW + " powers of ten below the tolerance " +
    "(the black mark) to " + DECADES_ABOVE + " above. A row is within tolerance when |a-b| <= atol + rtol*|b| at " +
    "every element, so one bar past its mark does not make it diverge (relative differences are large where b is " +
    "near zero); rows out of tolerance are red."));
  const grid = el("div", "rows");
  columnWidths(grid, table.rows);
  const head = el("div", "crow head");
  head.appendChild(el("span", "cell n", "a" + table.tag));
  head.appendChild(el("span", "cell n", "b" + table.tag));
  for (const name of [table.tag === "#" ? "op" : "node", "module", "verdict", "max |a-b| vs atol",
                      "max rel diff vs rtol", "note"]) {
    head.appendChild(el("span", "cell", name));
  }
  grid.appendChild(head);
  let previous = null;
  for (const row of table.rows) {
    grid.appendChild(rowElement(row, table.tag, previous));
    if (!row.cut) previous = row.p || "";
  }
  box.appendChild(grid);
  const first = table.first === null ? null : table.rows[table.first];
  if (first) first.el.classList.add("first");
  if (table.real !== undefined && table.real !== null) table.rows[table.real].el.classList.add("first-real");
  return box;
}

function focusRow(row) {
  bringIntoView(row.el);
  flash(row.el);
}

function filterRows(query, outOfTolerance, count) {
  const text = query.trim().toLowerCase();
  let shown = 0, total = 0;
  for (const table of TABLES) {
    for (const row of table.rows) {
      if (row.cut) {  // shown while nothing is filtered, and never counted as a row
        row.el.hidden = Boolean(text || outOfTolerance);
        continue;
      }
      const visible = (!outOfTolerance || row.v !== "within") &&
        (!text || row.o.toLowerCase().includes(text) || (row.p || "").toLowerCase().includes(text));
      row.el.hidden = !visible;
      shown += visible ? 1 : 0;
      total += 1;
    }
  }
  count.textContent = text || outOfTolerance ?
    shown + " of " + plural(total, "rows") + (DATA.cut ? " in this view" : "") + " shown" : "";
}

function main() {
  const app = ROOT;
  let count = null, onlyOut = null;
  const head = pageHeader(app, DATA.title, "filter by op or module path", function (value) {
    filterRows(value, onlyOut.checked, count);
  });
  count = head.count;
  const toggle = el("label");
  onlyOut = el("input");
  onlyOut.type = "checkbox";
  onlyOut.addEventListener("change", function () { filterRows(head.input.value, onlyOut.checked, count); });
  toggle.appendChild(onlyOut);
  toggle.appendChild(document.createTextNode(" only rows not within tolerance"));
  head.bar.appendChild(toggle);
  const lead = TABLES.find(function (table) { return table.first !== null; });
  const real = TABLES.find(function (table) { return table.real !== undefined && table.real !== null; });
  if (real) head.bar.appendChild(button("first real divergence", function () { focusRow(real.rows[real.real]); }, "bad"));
  if (lead) head.bar.appendChild(button("first divergence", function () { focusRow(lead.rows[lead.first]); }, "bad"));
  head.bar.appendChild(count);

  const body = el("main");
  for (const table of TABLES) body.appendChild(tableElement(table));
  app.appendChild(body);
  if (real && !EMBEDDED) bringIntoView(real.rows[real.real].el);  // a notebook view opens at its summary
  else if (lead && !EMBEDDED) bringIntoView(lead.rows[lead.first].el);
  drawn();
}

main();
