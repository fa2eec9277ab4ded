// Console helpers: copy a share link; select all rows of the queue. Everything works without them.
document.addEventListener("click", function (event) {
  var copy = event.target.closest("[data-copy]");
  if (copy) {
    var field = document.getElementById(copy.getAttribute("data-copy"));
    if (!field) return;
    field.select();
    var done = function () { copy.textContent = "Copied"; setTimeout(function () { copy.textContent = "Copy share link"; }, 2000); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(field.value).then(done, function () { document.execCommand("copy"); done(); });
    } else {
      document.execCommand("copy");
      done();
    }
  }
});
document.addEventListener("change", function (event) {
  if (event.target.matches("[data-select-all]")) {
    document.querySelectorAll("input[name=items]").forEach(function (box) { box.checked = event.target.checked; });
  }
});
// A refusal (the state moved on) comes back as 409 with a panel that says why: show it in place.
document.addEventListener("htmx:beforeSwap", function (event) {
  if (event.detail.xhr.status === 409) {
    event.detail.shouldSwap = true;
    event.detail.isError = false;
  }
});
// The queue refreshes itself every 30 s, but not while rows are ticked for a bulk action (a refresh would
// clear the ticks). This lives here, not in an hx-trigger filter: the Content-Security-Policy forbids eval.
document.addEventListener("htmx:beforeRequest", function (event) {
  var selector = event.detail.elt.getAttribute("data-poll-unless-checked");
  if (selector && document.querySelector(selector)) event.preventDefault();
});
