package publisher

// SetWaitAsking makes f run before each of Wait's asks of the status
// service, until the returned function restores what was there.
func SetWaitAsking(f func()) (restore func()) {
	old := waitAsking
	waitAsking = f
	return func() { waitAsking = old }
}

// SetTenantRequestSending makes f run right before TenantRequest
// publishes, until the returned function restores what was there.
func SetTenantRequestSending(f func()) (restore func()) {
	old := tenantRequestSending
	tenantRequestSending = f
	return func() { tenantRequestSending = old }
}
