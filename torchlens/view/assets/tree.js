/* The run page: the forward, then each backward, as module trees that fold.

   A module's children are built the first time it is opened, so a model of thousands of ops opens
   as fast as a small one. The first non-finite row and a failed run's attempted call have their
   ancestors opened on load. The filter matches rows by op name, label or module path and opens
   what it shows; clearing it puts back what was open before. Row and call keys are described in
   torchlens/view/tree.py. */

const NONFINITE = 1, HIGHLIGHT = 2, ATTEMPT = 4;
const SECTIONS = DATA.sections;
let openBeforeFilter = null;  // the calls open when filtering started, restored when it ends
let hitNodes = [];            // elements marked by the current filter

function link(call, section) {
  call.section = section;
  for (const kid of call.k) {
    if (kid.k) link(kid, section);
  }
}

function eachCall(call, fn) {
  fn(call);
  for (const kid of call.k) {
    if (kid.k) eachCall(kid, fn);
  }
}

/* A module's path, the part its parent's path already says faded, so the new part stands out. */
function pathElement(path, parentPath) {
  const node = el("span", "path");
  if (!path) {
    node.textContent = "(root)";
  } else if (parentPath && path.startsWith(parentPath + ".")) {
    node.appendChild(el("span", "up", parentPath + "."));
    node.appendChild(document.createTextNode(path.slice(parentPath.length + 1)));
  } else {
    node.textContent = path;
  }
  return node;
}

function callElement(call, parentPath) {
  const box = el("div", "mod");
  const head = el("div", "mrow");
  head.tabIndex = 0;
  head.setAttribute("role", "button");
  head.setAttribute("aria-expanded", "false");
  head.appendChild(el("span", "tw"));
  head.appendChild(pathElement(call.p, parentPath));
  head.appendChild(el("span", "cls", call.c));
  head.appendChild(el("span", "cnt", plural(call.n, call.section.unit)));
  if (call.x) head.appendChild(el("span", "nfc", call.x + " non-finite"));
  const kids = el("div", "kids");
  box.appendChild(head);
  box.appendChild(kids);
  box.tlCall = call;
  call.el = box;
  call.head = head;
  call.kids = kids;
  return box;
}

function rowTag(row, section) {
  switch (row.t) {
    case "out": return "=>";
    case "grad": return "<=";
    case "node": return "~" + row.i;
    case "try": return row.i === undefined ? "!!" : section.tag + row.i;
    default: return "#" + row.i;
  }
}

function rowElement(row, section) {
  if (row.t === "cut") {  // rows a notebook view left out: how many, in their place
    row.el = el("div", "op k-cut", row.o);
    return row.el;
  }
  const flags = row.f || 0;
  let cls = "op k-" + (row.t || "op");
  if (flags & NONFINITE) cls += " nf";
  if (flags & HIGHLIGHT) cls += " first";
  if (flags & ATTEMPT) cls += " attempt";
  const box = el("div", cls);
  const line = el("div", "line");
  line.appendChild(el("span", "tag", rowTag(row, section)));
  line.appendChild(el("span", "name", row.o));
  const rest = el("span", "rest");
  if (flags & ATTEMPT) rest.appendChild(el("span", "badge", "attempted: failed"));
  rest.appendChild(el("span", "meta", row.m));
  if (row.l) rest.appendChild(el("span", "label", row.l));
  if (row.b) {
    const ordinal = /^#(\d+)/.exec(row.b);
    const ref = el("span", ordinal ? "fwd" : "label", "<- " + row.b);
    if (ordinal) {
      ref.dataset.ordinal = ordinal[1];
      ref.title = "show the forward op";
    }
    rest.appendChild(ref);
  }
  if (row.s) rest.appendChild(el("span", "site", row.s));
  if (row.v) rest.appendChild(el("span", "stats", "| " + row.v));
  line.appendChild(rest);
  box.appendChild(line);
  for (const note of row.w || []) box.appendChild(el("div", "note", note));
  row.el = box;
  return box;
}

function render(call) {
  if (call.rendered) return;
  const frag = document.createDocumentFragment();
  for (const kid of call.k) {
    frag.appendChild(kid.k ? callElement(kid, call.p) : rowElement(kid, call.section));
  }
  call.kids.appendChild(frag);
  call.rendered = true;
}

function setOpen(call, open) {
  if (open) render(call);
  call.el.classList.toggle("open", open);
  call.head.setAttribute("aria-expanded", open ? "true" : "false");
}

/* Open every call on the way to the row at `path` (child indices from the root); returns its element. */
function reveal(section, path) {
  let node = section.tree;
  for (const index of path) {
    setOpen(node, true);
    node = node.k[index];
  }
  return node.el;
}

function show(section, path) {
  const node = reveal(section, path);
  bringIntoView(node);
  flash(node);
}

/* The path of forward op #ordinal, for the backward rows' links to the op they differentiate. */
let forwardPaths = null;
function forwardPath(ordinal) {
  if (forwardPaths === null) {
    forwardPaths = new Map();
    const walk = function (call, prefix) {
      call.k.forEach(function (kid, index) {
        const path = prefix.concat([index]);
        if (kid.k) walk(kid, path);
        else if (kid.t === undefined || kid.t === "in") forwardPaths.set(kid.i, path);
      });
    };
    walk(SECTIONS[0].tree, []);
  }
  return forwardPaths.get(ordinal);
}

function summaryLines(section) {
  const list = el("ul", "lines");
  for (const line of section.lines) {
    const item = el("li", line.cls);
    if (line.at) {
      item.appendChild(button(line.text, function () { show(section, line.at); }, "jump"));
    } else {
      item.textContent = line.text;
    }
    list.appendChild(item);
  }
  return list;
}

function sectionElement(section) {
  const box = el("section", "run");
  box.appendChild(el("h2", null, section.title));
  box.appendChild(summaryLines(section));
  const tree = el("div", "tree");
  tree.appendChild(callElement(section.tree, ""));
  box.appendChild(tree);
  if (section.footer && section.footer.length) box.appendChild(el("pre", "footer", section.footer.join("\n")));
  if (section.failure) {
    const failure = el("div", "failure");
    failure.appendChild(el("h3", null, "crash tail: the last lines narrated before the failure"));
    failure.appendChild(el("pre", null, section.failure.tail));
    box.appendChild(failure);
  }
  return box;
}

function allCalls(fn) {
  for (const section of SECTIONS) eachCall(section.tree, fn);
}

function expandAll() {
  const start = performance.now();
  allCalls(function (call) { setOpen(call, true); });
  void ROOT.offsetHeight;  // include the layout the browser does before it paints
  timings.expandAll = performance.now() - start;
}

function collapseAll() {
  allCalls(function (call) {
    if (call.el) setOpen(call, call === call.section.tree);
  });
}

/* Mark which rows match `query` and which calls hold a match, without touching the page. */
function markMatches(call, query) {
  const pathHit = call.p.toLowerCase().includes(query);
  let matches = 0;
  for (const kid of call.k) {
    if (kid.k) {
      matches += markMatches(kid, query);
    } else {
      kid.hit = kid.t !== "cut" && (pathHit || kid.o.toLowerCase().includes(query) ||
        (kid.l !== undefined && kid.l.toLowerCase().includes(query)));
      if (kid.hit && kid.t !== "out" && kid.t !== "try") matches += 1;  // counted as the total counts
    }
  }
  call.hits = matches;
  return matches;
}

function showMatches(call) {
  setOpen(call, true);
  call.el.classList.add("hit");
  hitNodes.push(call.el);
  for (const kid of call.k) {
    if (kid.k) {
      if (kid.hits) showMatches(kid);
    } else if (kid.hit) {
      kid.el.classList.add("hit");
      hitNodes.push(kid.el);
    }
  }
}

function filter(value, count) {
  const start = performance.now();
  const query = value.trim().toLowerCase();
  for (const node of hitNodes) node.classList.remove("hit");
  hitNodes = [];
  if (!query) {
    if (openBeforeFilter !== null) {
      allCalls(function (call) { if (call.el) setOpen(call, openBeforeFilter.has(call)); });
      openBeforeFilter = null;
    }
    ROOT.classList.remove("filtering");
    count.textContent = "";
    return;
  }
  if (openBeforeFilter === null) {
    openBeforeFilter = new Set();
    allCalls(function (call) { if (call.el && call.el.classList.contains("open")) openBeforeFilter.add(call); });
  }
  let matches = 0, rows = 0;
  for (const section of SECTIONS) {
    matches += markMatches(section.tree, query);
    rows += section.shown === undefined ? section.tree.n : section.shown;  // (a cut view searches what it holds)
    if (section.tree.hits) showMatches(section.tree);
  }
  ROOT.classList.add("filtering");
  count.textContent = matches + " of " + plural(rows, "rows") + (DATA.cut ? " in this view" : "") + " match";
  void ROOT.offsetHeight;
  timings.filter = performance.now() - start;
}

/* What the page leads to on load: a failure first, then the first non-finite row. */
function target() {
  for (const key of ["failure", "first"]) {
    for (const section of SECTIONS) {
      const path = key === "failure" ? section.failure && section.failure.at : section.first;
      if (path) return [section, path];
    }
  }
  return null;
}

function main() {
  const app = ROOT;
  let count = null;
  const head = pageHeader(app, DATA.title, "filter by op name or module path", function (value) {
    filter(value, count);
  });
  count = head.count;
  head.bar.appendChild(button("expand all", expandAll));
  head.bar.appendChild(button("collapse all", collapseAll));
  const failed = SECTIONS.find(function (s) { return s.failure && s.failure.at; });
  if (failed) {
    head.bar.appendChild(button("attempted call", function () { show(failed, failed.failure.at); }, "bad"));
  }
  const nonfinite = SECTIONS.find(function (s) { return s.first; });
  if (nonfinite) {
    head.bar.appendChild(button("first non-finite", function () { show(nonfinite, nonfinite.first); }, "bad"));
  }
  head.bar.appendChild(count);

  const body = el("main");
  for (const section of SECTIONS) {
    link(section.tree, section);
    body.appendChild(sectionElement(section));
    setOpen(section.tree, true);
    for (const path of [section.first, section.failure && section.failure.at]) {
      if (path) reveal(section, path);
    }
  }
  app.appendChild(body);

  body.addEventListener("click", function (event) {
    const ref = event.target.closest(".fwd");
    if (ref) {
      const path = forwardPath(Number(ref.dataset.ordinal));
      if (path) show(SECTIONS[0], path);
      return;
    }
    const head = event.target.closest(".mrow");
    if (head) {
      const call = head.parentNode.tlCall;
      setOpen(call, !call.el.classList.contains("open"));
    }
  });
  body.addEventListener("keydown", function (event) {
    if ((event.key === "Enter" || event.key === " ") && event.target.classList.contains("mrow")) {
      event.preventDefault();
      event.target.click();
    }
  });

  const lead = target();
  if (lead) {
    const node = reveal(lead[0], lead[1]);
    if (!EMBEDDED) bringIntoView(node);  // a notebook view opens at its header and summary, the row one click away
  }
  drawn();
}

main();
