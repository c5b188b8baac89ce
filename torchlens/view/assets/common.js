/* torchlens HTML view, shared by the run page and the comparison page: the embedded data, element
   construction (text only ever goes in through textContent, so no name in the data is markup),
   the page header with its sticky toolbar, and the timings a reader (or a test) can look at in
   window.torchlensView.timings. */
"use strict";

const T0 = performance.now();
const DATA = JSON.parse(document.getElementById("torchlens-data").textContent);
const timings = { parse: performance.now() - T0 };
window.torchlensView = { timings: timings };

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
  app.appendChild(head);
  const bar = el("div", "toolbar");
  const input = el("input");
  input.type = "search";
  input.placeholder = placeholder;
  input.setAttribute("aria-label", placeholder);
  input.addEventListener("input", debounced(function () { onFilter(input.value); }, 120));
  const count = el("span", "count");
  bar.appendChild(input);
  app.appendChild(bar);
  return { bar: bar, input: input, count: count };
}

/* Scroll `node` into the middle of the window unless it is already in view. */
function bringIntoView(node) {
  const box = node.getBoundingClientRect();
  if (box.top < 50 || box.bottom > window.innerHeight) node.scrollIntoView({ block: "center" });
}

function flash(node) {
  node.classList.remove("flash");
  void node.offsetWidth;  // restart the animation
  node.classList.add("flash");
}
