package tenantapi

import "testing"

// replyAllowed's edge cases, including replies the server itself refuses
// to carry (a trailing dot, wildcards).
func TestReplyAllowed(t *testing.T) {
	t.Parallel()
	for reply, ok := range map[string]bool{
		"_R_.abc.def":         true,
		"_R_.":                false,
		"_R_.*":               false,
		"_R_.a >":             false,
		"_INBOX_acme.x":       true,
		"_INBOX_acme.x.y":     true,
		"_INBOX_acme.":        false,
		"_INBOX_acme":         false,
		"_INBOX_acme.>":       false,
		"_INBOX_acmex.y":      false,
		"_INBOX_acme-corp.y":  false,
		"_INBOX.x":            false,
		"$KV.buildq-builds.k": false,
	} {
		if got := ReplyAllowed(false, "acme", reply); got != ok {
			t.Errorf("replyAllowed(acme, %q) = %v, want %v", reply, got, ok)
		}
	}
	if ReplyAllowed(false, "_invalid", "_INBOX__invalid.x") {
		t.Error("a subject without a valid tenant has no inbox")
	}
	if !ReplyAllowed(true, "acme", "_INBOX.x") {
		t.Error("AnyReply answers any reply")
	}
}
