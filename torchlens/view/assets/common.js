/* torchlens HTML view, shared by the run page and the comparison page: the embedded data, element
   construction (text only ever goes in through textContent, so no name in the data is markup),
   the page header with its sticky toolbar, and the timings a reader (or a test) can look at in
   window.torchlensView.timings.

   page.py runs these files inside `(function (root) { ... })(container)`: `root` is the view's
   container, which holds its data. Nothing here reaches outside it (no global name, no class on
   the document's body), so several views can share one document, as in a notebook. */
"use strict";

const T0 = performance.now();
const ROOT = root;
const EMBEDDED = ROOT.classList.contains("embedded");  // a notebook cell's output: it scrolls in its own box
const DATA = JSON.parse(ROOT.querySelector(":scope > script.torchlens-data").textContent);
const timings = { parse: performance.now() - T0 };
window.torchlensView = ROOT.torchlensView = { timings: timings };  // (the window's: the view drawn last)

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null && text !== "") node.textContent = text;
  return node;
}

function button(label, onClick, cls) {
  const node = el("button", cls, label);
  node.type = "button";
  node.addEventListener("click", onClick);
  return node;
}

function plural(count, noun) {
  return count + " " + (count === 1 ? noun.replace(/s$/, "") : noun);
}

/* Run `fn` once typing pauses: filtering a few thousand rows per keystroke is wasted work. */
function debounced(fn, ms) {
  let timer = 0;
  return function () {
    clearTimeout(timer);
    timer = setTimeout(fn, ms);
  };
}

/* The title, then a toolbar that stays at the top while the page scrolls, holding the filter box.
   Returns the toolbar, the box and a match count, which the caller adds after its own buttons. */
function pageHeader(app, title, placeholder, onFilter) {
  const head = el("header", "top");
  head.appendChild(el("h1", null, title));
  if (DATA.cut) head.appendChild(el("p", "cut", DATA.cut));  // what a notebook view left out, and how to see it all
  app.appendChild(head);
  const bar = el("div", "toolbar");
  const input = el("input");
  input.type = "search";
  input.placeholder = placeholder;
  input.setAttribute("aria-label", placeholder);
  input.addEventListener("input", debounced(function () { onFilter(input.value); }, 120));
  if (EMBEDDED) {  // typing here is for the view, not for the notebook's own key shortcuts
    input.addEventListener("keydown", function (event) { event.stopPropagation(); });
  }
  const count = el("span", "count");
  bar.appendChild(input);
  app.appendChild(bar);
  return { bar: bar, input: input, count: count };
}

/* Scroll `node` into the middle of the window unless it is already in view; embedded, into the
   middle of the view's own box, leaving the document around it where the reader has it. */
function bringIntoView(node) {
  const box = node.getBoundingClientRect();
  if (!EMBEDDED) {
    if (box.top < 50 || box.bottom > window.innerHeight) node.scrollIntoView({ block: "center" });
    return;
  }
  const view = ROOT.getBoundingClientRect();
  if (box.top < view.top + 50 || box.bottom > view.bottom) {
    ROOT.scrollTop += box.top - view.top - (ROOT.clientHeight - box.height) / 2;
  }
}

/* The view is drawn: what showed in its place until now (in a notebook, the note for a reader
   whose notebook runs no script) goes. */
function drawn() {
  const fallback = ROOT.querySelector(":scope > p.fallback");
  if (fallback) fallback.remove();
  timings.firstRender = performance.now() - T0;
}

function flash(node) {
  node.classList.remove("flash");
  void node.offsetWidth;  // restart the animation
  node.classList.add("flash");
}
