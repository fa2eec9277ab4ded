// Approver pages. A refused decision (400: no reason given, 403: not yours to decide, 409: already
// decided or expired) comes back as the decision panel saying why. htmx leaves 4xx answers unswapped
// by default, so swap these into the panel instead of failing silently.
document.addEventListener("htmx:beforeSwap", function (event) {
  var status = event.detail.xhr.status;
  var source = event.detail.elt;
  if ((status === 400 || status === 403 || status === 409) && source && source.closest("[data-decision]")) {
    event.detail.shouldSwap = true;
    event.detail.isError = false;
  }
});
